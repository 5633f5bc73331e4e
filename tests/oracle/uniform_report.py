"""How far the planner's uniform plans are from an exhaustive search, on small healthy clusters.

    .venv/bin/python -m tests.oracle.uniform_report [--instances N] [--write]   # --write: into BENCHMARKS.md

Written from the wire contract alone: it builds requests, asks `/v1/estimate` (the cost model applied to
one fully specified layout) for every uniform layout, and compares the best with the plan of
`allow_non_uniform: false`. Every layout means every tp dividing the heads, pp, dp, micro-batch size,
recompute mode, handcrafted schedule (1F1B, GPipe, ZB-H1, ZB-H2, interleaved with every v) and every
layer split (compositions of the layer count into pp parts). Healthy clusters only: there, where a
replica's groups sit does not change its time, so the estimate's own placement is not a choice the
oracle leaves to the planner. Not a test (issue 16 open): the planner optimizes the 1F1B bubble formula
and the estimate simulates the schedule, so the two can differ; this prints by how much.
"""

from __future__ import annotations

import argparse
import itertools
import random

from api.tasks.planning import estimate_for, plan_for
from benchmarks.report import write_section
from planner.errors import PlanningError
from wire.schemas import EstimateRequest, PlanRequest

SINGLE_CHUNK = ("1f1b", "gpipe", "zb-h1", "zb-h2")
RECOMPUTE = ("none", "full")  # what `recompute: auto` searches with flash attention (selective stores the same)


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


def _instance(rng: random.Random) -> dict:
    heads = rng.choice([4, 8, 16])
    kv = rng.choice([h for h in (1, 2, 4, 8, 16) if heads % h == 0])
    model = {"num_layers": rng.randint(3, 7), "hidden_size": heads * 128, "ffn_hidden_size": heads * 128 * 3,
             "num_attention_heads": heads, "num_kv_heads": kv, "vocab_size": 32000}
    return {"cluster": {"num_nodes": rng.choice([1, 2]), "gpus_per_node": rng.choice([4, 8]),
                        "gpu": rng.choice(["A100-40GB", "A100-80GB", "H100-SXM"])},
            "model": model,
            "training": {"global_batch_size": rng.choice([3, 4, 6, 8, 11, 12, 16]), "seq_length": 2048},
            "options": {"allow_non_uniform": False, "schedules": ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2"]}}


def _layouts(body: dict):
    model, cluster = body["model"], body["cluster"]
    layers, batch = model["num_layers"], body["training"]["global_batch_size"]
    gpus = cluster["num_nodes"] * cluster["gpus_per_node"]
    for tp in range(1, cluster["gpus_per_node"] + 1):
        if model["num_attention_heads"] % tp or model["num_kv_heads"] % tp:
            continue
        for pp in range(1, layers + 1):
            for dp in range(1, gpus // (tp * pp) + 1):
                for mbs in (m for m in range(1, batch + 1) if batch % (m * dp) == 0):
                    microbatches = batch // (mbs * dp)
                    for recompute in RECOMPUTE:
                        base = {"tp": tp, "pp": pp, "dp": dp, "micro_batch_size": mbs, "recompute": recompute}
                        for split in _compositions(layers, pp):
                            for schedule in SINGLE_CHUNK if pp > 1 else ("1f1b",):
                                yield {**base, "schedule": schedule, "layers_per_stage": split}
                        for v in range(2, 9):
                            if pp > 1 and layers % (pp * v) == 0 and microbatches % pp == 0:
                                yield {**base, "schedule": "interleaved", "virtual_stages": v}


def oracle_best(body: dict) -> tuple[float, dict | None]:
    best: tuple[float, dict | None] = (float("inf"), None)
    for layout in _layouts(body):
        try:
            time_s = estimate_for(EstimateRequest.model_validate({**body, "layout": layout})).predicted.iteration_time_s
        except PlanningError:
            continue
        if time_s < best[0]:
            best = (time_s, layout)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=20)
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
    lines = []
    rng = random.Random(args.seed)
    worse = []
    for index in range(args.instances):
        body = _instance(rng)
        try:
            plan = plan_for(PlanRequest.model_validate(body))
        except PlanningError:
            continue
        best_s, layout = oracle_best(body)
        gap = plan.predicted.iteration_time_s / best_s - 1
        worse.append(gap)
        lines.append(f"| {index} | {plan.predicted.iteration_time_s:.6f} ({plan.solver.status}) | {best_s:.6f} | "
                     f"{gap:+.3%} | {_describe(layout) if gap > 1e-3 else ''} |")
        print(lines[-1], flush=True)
    off = [g for g in worse if g > 1e-3]
    summary = (f"{len(worse)} instances (seed {args.seed}); the plan is more than 0.1% slower than the oracle's best "
               f"on {len(off)}" + (f", by up to {max(off):.2%}" if off else ""))
    print(summary)
    if args.write:
        body = (f"{summary}. Each instance: 1-2 nodes of 4 or 8 healthy GPUs, a 3-7-layer model (GQA or not), "
                "batches 3-16 (primes included), `allow_non_uniform: false`, the five handcrafted schedules allowed; "
                "the oracle estimates every uniform layout (tp, pp, dp, micro-batch size, recompute, schedule and "
                "chunks, every layer split) through `/v1/estimate`.\n\n"
                "| instance | plan s (status) | oracle best s | plan vs oracle | oracle's layout where it wins |\n"
                "|---:|---|---:|---:|---|\n" + "\n".join(lines))
        write_section("Uniform plans against an exhaustive oracle",
                      f"python -m tests.oracle.uniform_report --instances {args.instances} --write", body)


def _describe(layout: dict) -> str:
    return ", ".join(f"{key} {value}" for key, value in layout.items())


if __name__ == "__main__":
    main()
