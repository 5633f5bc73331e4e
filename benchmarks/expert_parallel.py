"""What expert parallelism buys a mixture of experts: the best plan with and without it.

    python -m benchmarks.expert_parallel            # print the table
    python -m benchmarks.expert_parallel --write    # also update BENCHMARKS.md

Each row is planned twice, `options.max_expert_parallel` 1 (the routed experts sharded over TP only, as a
trainer without EP runs them) and unbounded (expert-TP searched too: etp 1 beside TP), on a healthy cluster and with one GPU at half speed (whose EP
group then runs at its pace). Predicted times and memory, not timings: the figures do not depend on the
machine. The fidelity report (`benchmarks.fidelity`, "Per feature") prices published MoE runs: the figures here are
the cost model's, whose MoE error there is far larger than its dense one.
"""

from __future__ import annotations

import argparse

from benchmarks.planning import plan_or_none
from benchmarks.report import write_section

# (label, nodes, model, global batch, seq)
CASES = [
    ("64 x H100, mixtral-8x7b, 256 x 4k", 8, "mixtral-8x7b", 256, 4096),
    ("256 x H100, mixtral-8x7b, 1,024 x 4k", 32, "mixtral-8x7b", 1024, 4096),
    ("256 x H100, qwen2-57b-a14b, 1,024 x 4k", 32, "qwen2-57b-a14b", 1024, 4096),
    ("16 x H100, qwen3-30b-a3b, 64 x 4k", 2, "qwen3-30b-a3b", 64, 4096),
    ("64 x H100, gpt-oss-120b, 256 x 8k", 8, "gpt-oss-120b", 256, 8192),
    # long sequences: context parallelism searched beside EP, whose groups may take a replica's CP ranks
    ("64 x H100, qwen3-30b-a3b, 64 x 32k", 8, "qwen3-30b-a3b", 64, 32768),
    ("64 x H100, mixtral-8x7b, 64 x 32k", 8, "mixtral-8x7b", 64, 32768),
]
SLOW_SPEED = 0.5


def slow_gpu(nodes: int) -> list[dict]:
    """One GPU at half speed: GPU 2 of node 3, or of the last node on smaller clusters."""
    return [{"device": f"{min(3, nodes - 1)}:2", "speed": SLOW_SPEED}]


def _plan(nodes: int, model: str, batch: int, seq: int, max_ep: int | None, slow: list):
    body = {"cluster": {"num_nodes": nodes, "gpus_per_node": 8, "gpu": "H100-SXM"}, "model": model,
            "failures": {"slow": slow}, "training": {"global_batch_size": batch, "seq_length": seq},
            "options": {"time_limit_s": 30, "max_expert_parallel": max_ep}}
    return plan_or_none(body)


def _cell(plan) -> str:
    if plan is None:
        return "no layout fits"
    stages = plan.replicas[0].stages
    cp = f" cp {stages[0].cp}" if stages[0].cp > 1 else ""
    return (f"{plan.predicted.iteration_time_s:.3f} s (tp {stages[0].tp}{cp} pp {len(stages)} dp {len(plan.replicas)} "
            f"ep {plan.ep}{'' if plan.etp is None else f' etp {plan.etp}'}, {plan.recompute}; {max(s.memory_gib for r in plan.replicas for s in r.stages):.0f} GiB; "
            f"all-to-all {plan.predicted.breakdown.ep_comm_s:.3f} s; {plan.solver.status} gap {plan.solver.gap:.3f}"
            f"{'' if plan.uniform else ', non-uniform'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
    rows = []
    for label, *case in CASES:
        for damage, slow in (("healthy", []), (f"one GPU at {SLOW_SPEED}", slow_gpu(case[0]))):
            without, with_ep = _plan(*case, 1, slow), _plan(*case, None, slow)
            speedup = (without.predicted.iteration_time_s / with_ep.predicted.iteration_time_s
                       if without is not None and with_ep is not None else None)
            rows.append(f"| {label} | {damage} | {_cell(without)} | {_cell(with_ep)} | "
                        f"{'-' if speedup is None else f'{speedup:.2f}x'} |")
            print(rows[-1], flush=True)
    body = "\n".join([
        "Each request planned with `options.max_expert_parallel` 1 and unbounded (failure-aware planner, "
        "30 s limit). Predicted figures under the cost model; memory is the plan's fullest GPU. Both searches "
        "stop on their counted work (`stopped_by: work budget`), sized by the first pass's refinements, not "
        "on the time limit: where the unbounded one has twice the shapes to look at, its answer can come out "
        "slower than the EP 1 search's (its gap says how far from proven it is).",
        "",
        "| request | damage | EP 1 | EP searched | speedup |",
        "|---|---|---|---|---:|",
        *rows,
    ])
    if args.write:
        write_section("Expert parallelism", "python -m benchmarks.expert_parallel --write", body)


if __name__ == "__main__":
    main()
