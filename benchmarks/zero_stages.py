"""Which ZeRO stage `zero_stage: auto` picks, and what each stage's best stock plan predicts.

    python -m benchmarks.zero_stages            # print the table
    python -m benchmarks.zero_stages --write    # also update BENCHMARKS.md

Each case is planned with stock layouts (`allow_non_uniform: false`) at ZeRO-1, 2 and 3, and with `auto`
(`planner/zero_choice.py`), which must answer the fastest of the three. Predicted times, not timings:
the figures do not depend on the machine.
"""

from __future__ import annotations

import argparse

from benchmarks.planning import plan_or_none
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
    if args.write:
        write_section("ZeRO stages and zero_stage auto", "python -m benchmarks.zero_stages --write", body)


if __name__ == "__main__":
    main()
