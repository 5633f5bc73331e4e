"""Planner speed of two git revisions side by side, on the failure benchmark's 256-GPU scenarios.

    python -m benchmarks.revisions BASE [--against REV] [--rounds 2] [--write]

Checks both revisions out into temporary worktrees (the current working tree stands for `--against`
when it is not given), then plans every 256-GPU scenario of `benchmarks/failures.py` in a fresh process
per revision and round, alternating which goes first, so a shared machine's load falls on both alike.
Prints the total wall time of each, their ratio, the slowest scenario of each, and whether every answer
(predicted iteration time) is the same: a speed-up that changes answers is not one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.report import load_average, write_section

ROOT = Path(__file__).resolve().parent.parent

# Runs inside a revision's checkout: its own planner, the scenarios of this file's revision (passed in).
_CHILD = r"""
import json, sys, time
from wire.schemas import PlanRequest
from api.tasks.planning import plan_for
out = []
for body in json.loads(sys.stdin.read()):
    request = PlanRequest.model_validate(body)
    started = time.perf_counter()
    plan = plan_for(request)
    out.append([time.perf_counter() - started, plan.predicted.iteration_time_s])
print(json.dumps(out))
"""


def _requests() -> tuple[list[str], list[dict]]:
    from benchmarks.failures import request_for, scenarios

    cases = [s for s in scenarios() if s.setup.gpus == 256]
    return ([f"{s.setup.model}, {s.label}" for s in cases], [request_for(s.setup, s.failed, s.slow) for s in cases])


def _worktree(revision: str, into: str) -> str:
    path = os.path.join(into, revision.replace("/", "_"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", path, revision], check=True)
    return path


def _run(checkout: str, requests: list[dict]) -> list[list[float]]:
    out = subprocess.run([sys.executable, "-c", _CHILD], cwd=checkout, input=json.dumps(requests), text=True,
                         capture_output=True, check=True, env={**os.environ, "PYTHONPATH": checkout})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the revision to compare against (a commit, tag or branch)")
    parser.add_argument("--against", help="the revision measured (default: the working tree)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args(argv)
    labels, requests = _requests()
    load = load_average()
    with tempfile.TemporaryDirectory() as scratch:
        checkouts = {"base": _worktree(args.base, scratch),
                     "measured": _worktree(args.against, scratch) if args.against else str(ROOT)}
        try:
            runs: dict[str, list[list[list[float]]]] = {"base": [], "measured": []}
            for round_ in range(args.rounds):
                for name in ("base", "measured") if round_ % 2 == 0 else ("measured", "base"):
                    runs[name].append(_run(checkouts[name], requests))
        finally:
            for name in ("base", "measured"):
                if checkouts[name] != str(ROOT):
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", checkouts[name]], check=False)
    # Per scenario, the least of the rounds: the run least disturbed by the machine's other work.
    least = {name: [min(run[i][0] for run in runs[name]) for i in range(len(labels))] for name in runs}
    same = all(run[i][1] == runs["base"][0][i][1] for name in runs for run in runs[name] for i in range(len(labels)))
    totals = {name: sum(least[name]) for name in runs}
    over = {name: sum(1 for t in least[name] if t > 2.0) for name in runs}
    slowest = {name: max(range(len(labels)), key=lambda i: least[name][i]) for name in runs}
    measured = args.against or "working tree"
    lines = [
        f"| revision | total s | median s | slowest s (scenario) | over 2 s |",
        "|---|---:|---:|---|---:|",
        *(f"| {label} | {totals[name]:.2f} | {sorted(least[name])[len(labels) // 2]:.2f} | "
          f"{least[name][slowest[name]]:.2f} ({labels[slowest[name]]}) | {over[name]} of {len(labels)} |"
          for name, label in (("base", args.base), ("measured", measured))),
    ]
    summary = (f"{measured} / {args.base}: {totals['measured'] / totals['base']:.3f} of the time over {len(labels)} "
               f"scenarios (least of {args.rounds} alternating rounds each); answers "
               f"{'identical' if same else 'DIFFER'}. Machine {load} before the first round.")
    print("\n".join(lines))
    print(summary)
    if args.write:
        write_section("Planner revisions side by side", f"python -m benchmarks.revisions {args.base}"
                      + (f" --against {args.against}" if args.against else "") + f" --rounds {args.rounds} --write",
                      "256-GPU failure scenarios of `benchmarks/failures.py`, each revision planning them in its own "
                      "fresh process, alternating.\n\n" + "\n".join(lines) + "\n\n" + summary)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
