"""The same request planned 5 times beside CPU hogs: are the plans identical?

    python -m benchmarks.determinism            # print the table
    python -m benchmarks.determinism --write    # also update BENCHMARKS.md

Each request is planned REPEATS times in fresh processes while HOGS processes spin on the machine's
cores (the planner gets about a third of a core's share it would have idle), then once more with the
machine idle. A plan is compared without what depends on the clock (plan id, wall times); every run
must give the same plan as the idle one (`solver.stopped_by` left out of the comparison: it reports
the load, not the plan). `solver.stopped_by` says which limit ended each search: the
deterministic work budget (the same for every run), the wall-clock safety net (machine too slow, so
the answer may differ), or neither (the search finished).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import subprocess
import sys
from pathlib import Path

from benchmarks.report import load_average, write_section

ROOT = Path(__file__).resolve().parent.parent
REPEATS = 5
HOGS = 4
REQUESTS = [
    ("docs/slow-gpu-request.json", None),
    ("api/examples/mixed-256xa100-qwen2.5-32b.json", None),
    ("api/examples/slow-64xh100-llama3-8b.json", None),
    # A short limit: the search is cut by a budget, so only a deterministic budget gives equal plans.
    ("api/examples/healthy-256xa100-llama2-70b.json", 1.0),
]
# A search the work budget itself cuts (4,096 GPUs in 1 s): the cut falls at the same point of the
# counted work (`planner.work`) however loaded the machine.
CUT_REQUEST = {
    "cluster": {"num_nodes": 512, "gpus_per_node": 8, "gpu": "H100-SXM"},
    "failures": {"failed": ["9:0", "300:*"], "slow": [{"device": "100:4", "speed": 0.7}]},
    "model": "llama3-405b", "training": {"global_batch_size": 2048, "seq_length": 8192},
    "options": {"time_limit_s": 1.0},
}

_CHILD = r"""
import json, sys, time
from tests.golden.golden import without_clock
from wire.schemas import PlanRequest
from api.tasks.planning import plan_for
body = json.loads(sys.argv[1])
started = time.perf_counter()
plan = plan_for(PlanRequest.model_validate(body))
wall = time.perf_counter() - started
data = without_clock(json.loads(plan.model_dump_json()))
data["solver"].pop("stopped_by", None)  # which clock ended the search is load, not plan
print(json.dumps({"plan": data, "wall_s": wall, "status": plan.solver.status,
                  "stopped_by": plan.solver.stopped_by, "iteration_s": plan.predicted.iteration_time_s}))
"""


def _hog() -> None:
    while True:
        pass


def _plan_once(body: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(body)], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _digest(plan: dict) -> str:
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:12]


def run() -> str:
    rows = []
    for path, limit_s in [*REQUESTS, ("4,096 x H100, llama3-405b", None)]:
        body = json.loads((ROOT / path).read_text()) if path.endswith(".json") else CUT_REQUEST
        if limit_s is not None:
            body["options"] = {**body.get("options", {}), "time_limit_s": limit_s}
        idle = _plan_once(body)
        hogs = [multiprocessing.Process(target=_hog, daemon=True) for _ in range(HOGS)]
        for hog in hogs:
            hog.start()
        try:
            loaded = [_plan_once(body) for _ in range(REPEATS)]
        finally:
            for hog in hogs:
                hog.terminate()
        digests = {_digest(run["plan"]) for run in loaded}
        same = digests == {_digest(idle["plan"])}
        walls = [f"{r['wall_s']:.2f}" for r in loaded]
        stops = sorted({str(r["stopped_by"]) for r in loaded})
        label = path + (f", time_limit_s {limit_s:g}" if limit_s is not None else "")
        rows.append(
            f"| {label} | {idle['iteration_s']:.6f} ({idle['status']}, {idle['stopped_by']}) | {idle['wall_s']:.2f} | "
            f"{', '.join(walls)} | {', '.join(stops)} | {len(digests)} | {'yes' if same else 'NO'} |"
        )
        print(rows[-1], flush=True)
    header = (
        f"{REPEATS} runs per request, each in a fresh process, beside {HOGS} busy-looping processes on "
        f"{multiprocessing.cpu_count()} cores; then compared with one run on the idle machine. "
        f"Machine {load_average()} before the hogs.\n\n"
        "| request | idle: iteration s (status, stopped by) | idle solve s | loaded solve s | loaded stopped by | "
        "distinct loaded plans | all equal to idle |\n|---|---|---:|---|---|---:|---|"
    )
    return header + "\n" + "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
    body = run()
    print(body)
    if args.write:
        write_section("Determinism under load", "python -m benchmarks.determinism --write", body)


if __name__ == "__main__":
    main()
