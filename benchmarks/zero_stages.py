"""Which ZeRO stage `zero_stage: auto` picks, and what each stage's best stock plan predicts.

    python -m benchmarks.zero_stages            # print the table
    python -m benchmarks.zero_stages --write    # also update BENCHMARKS.md

Each case is planned with stock layouts (`allow_non_uniform: false`) at ZeRO-1, 2 and 3, and with `auto`
(`planner/zero_choice.py`), which must answer the fastest of the three. Predicted times, not timings:
the figures do not depend on the machine. A second table is a timing: what searching hybrid shard groups
costs, ZeRO-3 planned with and without them side by side in one run (shapes ranked, solve CPU seconds).
"""

from __future__ import annotations

import argparse
import time

from benchmarks.planning import plan_or_none
from planner.uniform.candidates import ranked_candidates
from wire.convert import to_problem
from wire.schemas import PlanRequest
from benchmarks.report import write_section

# (label, nodes, gpu, model, global batch, seq)
CASES = [
    ("16 x H100, llama3-8b, 64 x 8k", 2, "H100-SXM", "llama3-8b", 64, 8192),
    ("64 x H100, llama3-8b, 512 x 8k", 8, "H100-SXM", "llama3-8b", 512, 8192),
    ("64 x H100, llama3-70b, 256 x 8k", 8, "H100-SXM", "llama3-70b", 256, 8192),
    ("256 x A100-80GB, llama2-7b, 512 x 4k", 32, "A100-80GB", "llama2-7b", 512, 4096),
    ("32 x A100-40GB, llama2-13b, 128 x 4k", 4, "A100-40GB", "llama2-13b", 128, 4096),
]


def _plan(nodes: int, gpu: str, model: str, batch: int, seq: int, zero: int | str):
    body = {"cluster": {"num_nodes": nodes, "gpus_per_node": 8, "gpu": gpu}, "model": model,
            "training": {"global_batch_size": batch, "seq_length": seq, "zero_stage": zero},
            "options": {"allow_non_uniform": False, "time_limit_s": 30}}
    return plan_or_none(body)


def _cell(plan) -> str:
    if plan is None:
        return "no layout fits"
    stages = plan.replicas[0].stages
    hybrid = plan.zero_stage >= 1 and plan.dp_shard is not None and plan.dp_shard < len(plan.replicas)
    shard = f" shard {plan.dp_shard}" if hybrid else ""
    return (f"{plan.predicted.iteration_time_s:.3f} s (tp {stages[0].tp} pp {len(stages)} dp {len(plan.replicas)}"
            f"{shard}, mbs {plan.micro_batch_size}, {plan.recompute}; {max(s.memory_gib for s in stages):.0f} GiB)")


# (label, nodes, model, global batch): ZeRO-3 at 4k tokens on H100s, where a node's replicas are a shard group
SEARCH_COST_CASES = [("32 x H100, llama3-8b, 64 x 4k", 4, "llama3-8b", 64),
                     ("256 x H100, llama2-13b, 512 x 4k", 32, "llama2-13b", 512)]


def _search_cost_row(label: str, nodes: int, model: str, batch: int) -> str:
    """Shapes and solve CPU seconds of ZeRO-3 with hybrid shard groups searched and without (best of 3 each)."""
    cells = []
    for allow in (True, False):
        body = {"cluster": {"num_nodes": nodes, "gpus_per_node": 8, "gpu": "H100-SXM"}, "model": model,
                "training": {"global_batch_size": batch, "seq_length": 4096, "zero_stage": 3},
                "options": {"allow_non_uniform": False, "time_limit_s": 30, "allow_hybrid_sharding": allow}}
        shapes = len(ranked_candidates(to_problem(PlanRequest.model_validate(body)))[0])
        cpu_s, plan = float("inf"), None
        for _ in range(3):
            began = time.process_time()
            plan = plan_or_none(body)
            cpu_s = min(cpu_s, time.process_time() - began)
        shard = plan.dp_shard if plan is not None else "-"
        time_s = f"{plan.predicted.iteration_time_s:.3f} s" if plan is not None else "no layout fits"
        cells.append((shapes, cpu_s, f"{time_s}, dp_shard {shard}"))
    (with_shapes, with_cpu, with_plan), (without_shapes, without_cpu, without_plan) = cells
    return (f"| {label} | {with_shapes:,} / {without_shapes:,} ({with_shapes / without_shapes:.2f}x) | "
            f"{with_cpu:.2f} / {without_cpu:.2f} ({with_cpu / without_cpu:.2f}x) | {with_plan} | {without_plan} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
    rows = []
    for label, *case in CASES:
        by_stage = {zero: _plan(*case, zero) for zero in (1, 2, 3)}
        chosen = _plan(*case, "auto")
        fitting = [plan.predicted.iteration_time_s for plan in by_stage.values() if plan is not None]
        agrees = chosen is not None and abs(chosen.predicted.iteration_time_s - min(fitting)) < 1e-9
        rows.append(f"| {label} | " + " | ".join(_cell(by_stage[zero]) for zero in (1, 2, 3))
                    + f" | {chosen.zero_stage if chosen else '-'}{'' if agrees else ' (not the fastest!)'} |")
        print(rows[-1], flush=True)
    body = ("Best stock plan per ZeRO stage (predicted iteration time; layout; largest stage memory) and the stage "
            "`auto` answers. ZeRO-2 and 3 free the memory ZeRO-1 spends on whole gradients (and weights), which "
            "buys smaller TP or PP, larger micro-batches or less recompute; they pay a reduce-scatter in every "
            "microbatch (and ZeRO-3 two gathers per layer), hidden while a layer's compute outlasts its "
            "collectives. `shard s`: hybrid sharding, the state sharded over a node's s replicas and replicated "
            "across nodes, which keeps those collectives on NVLink for more memory (it loses where the step-end "
            "all-reduce across nodes costs more than the per-layer collectives it moves).\n\n"
            "| case | ZeRO-1 | ZeRO-2 | ZeRO-3 | auto picks |\n|---|---|---|---|---:|\n" + "\n".join(rows))
    cost_rows = [_search_cost_row(*case) for case in SEARCH_COST_CASES]
    print("\n".join(cost_rows), flush=True)
    body += ("\n\nWhat searching hybrid shard groups costs (ZeRO-3, stock layouts; timings of this run, best of 3, "
             "side by side): shapes ranked and solve CPU seconds with / without "
             "(`options.allow_hybrid_sharding`), and the plans.\n\n"
             "| case | shapes | solve CPU s | plan with | plan without |\n|---|---|---|---|---|\n"
             + "\n".join(cost_rows))
    if args.write:
        write_section("ZeRO stages and zero_stage auto", "python -m benchmarks.zero_stages --write", body)


if __name__ == "__main__":
    main()
