"""How long each trainer export and launch command takes for the largest plans the service accepts.

    python -m benchmarks.export_time            # print the table
    python -m benchmarks.export_time --write    # also update BENCHMARKS.md

The plans are synthesized (a planner run at this size takes minutes and is not what is measured):
llama3-405b on 16,384 nodes x 8 GPUs, tp 8 x pp 16 in Megatron's rank order, with every node used
(dp 1,024), and with the last 1,024 nodes left unused (dp 960, 8,192 unused devices listed per node
in the comments). Each export runs three times; the table gives the fastest.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable

from adapters import deepspeed, json_plan, megatron, torchtitan
from cost_models.model_spec import model_preset
from wire.schemas import Plan

NODES, GPUS_PER_NODE, TP, PP = 16_384, 8, 8, 16
MODEL = "llama3-405b"
EXPORTS: dict[str, Callable[[Plan], str]] = {
    "megatron render": megatron.render,
    "megatron launch_command": megatron.launch_command,
    "deepspeed render": deepspeed.render,
    "deepspeed launch_command": deepspeed.launch_command,
    "torchtitan render": torchtitan.render,
    "torchtitan launch_command": torchtitan.launch_command,
    "json render": json_plan.render,
}


def synthetic_plan(used_nodes: int) -> Plan:
    """A uniform 1F1B plan on the first `used_nodes` nodes, ranks in Megatron's tp-dp-pp order."""
    dp = used_nodes * GPUS_PER_NODE // (TP * PP)
    spec = model_preset(MODEL)
    per_stage = [spec.num_layers // PP] * PP
    for stage in range(spec.num_layers - sum(per_stage)):
        per_stage[stage + 1] += 1
    bounds = [0]
    for layers in per_stage:
        bounds.append(bounds[-1] + layers)

    def device(rank: int) -> str:
        return f"{rank // GPUS_PER_NODE}:{rank % GPUS_PER_NODE}"

    replicas = [
        {"id": replica, "num_microbatches": 16, "stages": [
            {"id": stage, "layers": (bounds[stage], bounds[stage + 1]), "tp": TP, "memory_gib": 60.0,
             "forward_ms": 10.0, "backward_ms": 20.0,
             "devices": [device((stage * dp + replica) * TP + t) for t in range(TP)]}
            for stage in range(PP)]}
        for replica in range(dp)
    ]
    unused = [f"{node}:{gpu}" for node in range(used_nodes, NODES) for gpu in range(GPUS_PER_NODE)]
    return Plan.model_validate({
        "plan_id": f"synthetic-{used_nodes}-nodes", "status": "optimal", "uniform": True, "micro_batch_size": 1,
        "schedule": "1f1b", "virtual_stages": 1, "recompute": "selective", "zero_stage": 1, "replicas": replicas,
        "unused_devices": unused, "excluded_devices": [],
        "predicted": {"iteration_time_s": 1.0, "tokens_per_s": 1.0, "mfu": 0.5,
                      "breakdown": {"compute_s": 1.0, "pipeline_bubble_s": 0.0, "tp_comm_s": 0.0, "dp_comm_s": 0.0}},
        "solver": {"status": "OPTIMAL", "wall_time_s": 0.0, "gap": 0.0},
        "architecture": dataclasses.asdict(spec), "global_batch_size": dp * 16, "seq_length": 8192,
        "precision": "bf16",
    })


def fastest_s(export: Callable[[Plan], str], plan: Plan, runs: int = 3) -> tuple[float, int]:
    times, size = [], 0
    for _ in range(runs):
        started = time.perf_counter()
        size = len(export(plan))
        times.append(time.perf_counter() - started)
    return min(times), size


def table() -> str:
    plans = {"all 16,384 nodes": synthetic_plan(NODES), "15,360 nodes, 1,024 unused": synthetic_plan(NODES - 1024)}
    rows = ["| export | " + " | ".join(plans) + " |", "|---|" + "---|" * len(plans)]
    for name, export in EXPORTS.items():
        cells = []
        for plan in plans.values():
            seconds, size = fastest_s(export, plan)
            shown = f"{size / 1e6:.1f} MB" if size >= 100_000 else f"{size / 1e3:.1f} kB"
            cells.append(f"{seconds:.2f} s ({shown})")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return (f"{MODEL}, {NODES * GPUS_PER_NODE:,} GPUs (tp {TP} x pp {PP}), synthesized plans; fastest of 3 runs, "
            "output size in brackets.\n\n" + "\n".join(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    body = table()
    print(body)
    if parser.parse_args().write:
        from benchmarks.report import write_section

        write_section("Trainer exports at 131,072 GPUs", "python -m benchmarks.export_time --write", body)


if __name__ == "__main__":
    main()
