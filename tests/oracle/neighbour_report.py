"""Failure-aware plans against their neighbours: is any layout one layer or one microbatch away faster?

    .venv/bin/python -m tests.oracle.neighbour_report [--instances N] [--seed S]

A local check of the failure-aware planner where no exhaustive oracle reaches (issue 16): for each of
`tests/oracle/enumerator.py`'s small instances with 0-2 failed or slow GPUs, every layout that moves one
stage boundary of one replica by one layer, or one microbatch from one replica to another, is estimated
through `/v1/estimate` (`layout.replicas`) under every allowed single-chunk schedule (or interleaved, for a
chunked plan), and the report says how many plans have a neighbour faster by more than 0.1%.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import random

from api.tasks.planning import estimate_for, plan_for
from planner.errors import PlanningError
from tests.oracle.enumerator import SINGLE_CHUNK, allowed_schedules, instance, with_failures
from wire.schemas import EstimateRequest, PlanRequest

GAIN = 1e-3  # below the figures' rounding


def _replicas(plan) -> list[dict]:
    return [{"num_microbatches": r.num_microbatches,
             "stages": [{"devices": list(s.devices), "layers": list(s.layers)} for s in r.stages]} for r in plan.replicas]


def neighbours(plan) -> list[tuple[str, list[dict]]]:
    """(what moved, the replicas) of every layout one microbatch or one layer away from the plan."""
    replicas = _replicas(plan)
    out = []
    for giver, taker in itertools.permutations(range(len(replicas)), 2):
        if replicas[giver]["num_microbatches"] > 1:
            moved = copy.deepcopy(replicas)
            moved[giver]["num_microbatches"] -= 1
            moved[taker]["num_microbatches"] += 1
            out.append((f"a microbatch from replica {giver} to {taker}", moved))
    for r, replica in enumerate(replicas):
        for s in range(len(replica["stages"]) - 1):
            for step in (1, -1):
                moved = copy.deepcopy(replicas)
                left, right = moved[r]["stages"][s], moved[r]["stages"][s + 1]
                cut = left["layers"][1] + step
                if left["layers"][0] < cut < right["layers"][1]:
                    left["layers"][1] = right["layers"][0] = cut
                    out.append((f"replica {r}: layer boundary {s}|{s + 1} by {step:+d}", moved))
    return out


def _estimate_ms(body: dict, plan, replicas: list[dict], schedule: str) -> float | None:
    layout = {"micro_batch_size": plan.micro_batch_size, "virtual_stages": plan.virtual_stages,
              "recompute": plan.recompute, "replicas": replicas, "schedule": schedule}
    try:
        return estimate_for(EstimateRequest.model_validate({**body, "layout": layout})).predicted.iteration_time_s * 1e3
    except PlanningError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=24)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    planned = better = 0
    for index in range(args.instances):
        body = with_failures(rng, instance(rng))
        body = {**body, "options": {**body["options"], "allow_non_uniform": True, "time_limit_s": 30}}
        try:
            plan = plan_for(PlanRequest.model_validate(body))
        except PlanningError:
            continue
        planned += 1
        plan_ms = plan.predicted.iteration_time_s * 1e3
        names = ["interleaved"] if plan.virtual_stages > 1 else [n for n in allowed_schedules(body) if n in SINGLE_CHUNK]
        best = (plan_ms, "none")
        for what, replicas in neighbours(plan):
            for name in names:
                ms = _estimate_ms(body, plan, replicas, name)
                if ms is not None and ms < best[0]:
                    best = (ms, f"{what}, {name}")
        gain = 1 - best[0] / plan_ms
        better += gain > GAIN
        print(f"{index}: plan {plan_ms:.3f} ms ({plan.schedule}, {'uniform' if plan.uniform else 'non-uniform'}, "
              f"gap {plan.solver.gap:.1%}); best neighbour {best[0]:.3f} ms ({best[1]}), {gain:.2%}", flush=True)
    print(f"{planned} plans (seed {args.seed}); {better} with a neighbour faster by more than {GAIN:.1%}")


if __name__ == "__main__":
    main()
