"""What breadth-first pipelining (looped BFS) buys where data parallelism is wide and microbatches are few.

    python -m benchmarks.breadth_first            # print the table
    python -m benchmarks.breadth_first --write    # also update BENCHMARKS.md

Each case is planned twice with stock layouts (`allow_non_uniform: false`): with the schedules Megatron-LM
runs (1F1B, interleaved) and with looped BFS allowed too (torchtitan and PyTorch run it), and the best
layout of each is reported. Predicted times, not timings: the figures do not depend on the machine.
"""

from __future__ import annotations

import argparse

from api.tasks.planning import plan_for
from benchmarks.report import write_section
from wire.schemas import PlanRequest

# (label, nodes, gpu, model, global batch, seq, network GB/s per GPU or None: the preset's)
CASES = [
    ("128 x H100, llama3-8b, 256 x 8k", 16, "H100-SXM", "llama3-8b", 256, 8192, None),
    ("512 x H100, llama3-70b, 256 x 8k", 64, "H100-SXM", "llama3-70b", 256, 8192, None),
    ("1,024 x H100, llama3-70b, 256 x 8k", 128, "H100-SXM", "llama3-70b", 256, 8192, None),
    ("1,024 x H100 on 200 Gb/s NICs, llama3-70b, 256 x 8k", 128, "H100-SXM", "llama3-70b", 256, 8192, 25.0),
    ("1,024 x H100, llama3-70b, 1,024 x 8k", 128, "H100-SXM", "llama3-70b", 1024, 8192, None),
    ("256 x A100, llama2-13b, 128 x 4k", 32, "A100-80GB", "llama2-13b", 128, 4096, None),
]
STOCK = ["1f1b", "interleaved"]


def _plan(nodes: int, gpu: str, model: str, batch: int, seq: int, network_gb_s: float | None, schedules: list[str]):
    cluster = {"num_nodes": nodes, "gpus_per_node": 8, "gpu": gpu}
    if network_gb_s is not None:
        cluster["inter_node_bandwidth_gb_s"] = network_gb_s
    body = {"cluster": cluster, "model": model,
            "training": {"global_batch_size": batch, "seq_length": seq},
            "options": {"allow_non_uniform": False, "schedules": schedules, "time_limit_s": 30}}
    return plan_for(PlanRequest.model_validate(body))


def _layout(plan) -> str:
    stages = plan.replicas[0].stages
    chunks = f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else ""
    return (f"tp {stages[0].tp} pp {len(stages)} dp {len(plan.replicas)}, {plan.replicas[0].num_microbatches} x "
            f"mbs {plan.micro_batch_size}, {plan.schedule}{chunks}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
    rows = []
    for label, nodes, gpu, model, batch, seq, network_gb_s in CASES:
        stock = _plan(nodes, gpu, model, batch, seq, network_gb_s, STOCK)
        bfs = _plan(nodes, gpu, model, batch, seq, network_gb_s, [*STOCK, "looped-bfs"])
        gain = 1 - bfs.predicted.iteration_time_s / stock.predicted.iteration_time_s
        rows.append(
            f"| {label} | {stock.predicted.iteration_time_s:.3f} s ({_layout(stock)}; sync "
            f"{stock.predicted.breakdown.dp_comm_s:.3f} s) | {bfs.predicted.iteration_time_s:.3f} s ({_layout(bfs)}; sync "
            f"{bfs.predicted.breakdown.dp_comm_s:.3f} s) | {100 * gain:.1f}% | {stock.solver.status} / {bfs.solver.status} |"
        )
        print(rows[-1], flush=True)
    body = ("Best stock plan without and with looped BFS (predicted iteration time, its layout, the exposed "
            "gradient sync). Breadth-first finishes a stage's chunks one after another, so each finished "
            "chunk's sync runs under the backward of the chunks before it (`planner/schedules/sync.py`); it "
            "holds every microbatch until its first backward, so it wins where microbatches per replica are "
            "few and the sync is large: many replicas across nodes.\n\n"
            "| cluster, model, batch | 1F1B / interleaved | with looped BFS | faster by | status |\n"
            "|---|---|---|---|---|\n" + "\n".join(rows))
    print(body)
    if args.write:
        write_section("Breadth-first pipelining", "python -m benchmarks.breadth_first --write", body)


if __name__ == "__main__":
    main()
