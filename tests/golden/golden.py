"""Golden plans: what the planner answered for the sample requests before the package layout moved.

    .venv/bin/python -m tests.golden.golden --write    # (re)write tests/golden/plans/*.json

Written once, before the moves of the package-layout change (and again only when a change means to alter
plans); tests/golden/test_golden_plans.py checks every later tree against them. What depends on the clock
is left out: plan ids and wall times. Each request is planned with a time limit far above what it needs
(the search and the schedule step finish, so the answer is the proven one) and a fixed seed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
GOLDEN_DIR = Path(__file__).resolve().parent / "plans"
REQUESTS = sorted((ROOT / "api" / "examples").glob("*.json")) + sorted((ROOT / "docs").glob("*-request.json"))
# Far above any sample's solve time: nothing is cut by the clock.
TIME_LIMIT_S = 120
# Fields that hold the clock: when the plan was made, how long it took, how much of the budget was left,
# which clock ended the search (the wall clock only on a machine too loaded for the work clock).
_CLOCK_FIELDS = {"plan_id", "wall_time_s", "time_limit_s", "stopped_by"}


def golden_request(path: Path) -> dict[str, Any]:
    body = json.loads(path.read_text())
    body["options"] = {**body.get("options", {}), "time_limit_s": TIME_LIMIT_S, "random_seed": 0}
    return body


def without_clock(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: without_clock(item) for key, item in value.items() if key not in _CLOCK_FIELDS}
    if isinstance(value, list):
        return [without_clock(item) for item in value]
    return value


def plan_json(body: dict[str, Any]) -> dict[str, Any]:
    from api.tasks.planning import plan_for
    from wire.schemas import PlanRequest

    return without_clock(json.loads(plan_for(PlanRequest.model_validate(body)).model_dump_json()))


def golden_path(request_path: Path) -> Path:
    return GOLDEN_DIR / f"{request_path.parent.name}-{request_path.name}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    GOLDEN_DIR.mkdir(exist_ok=True)
    for path in REQUESTS:
        plan = plan_json(golden_request(path))
        target = golden_path(path)
        if args.write:
            target.write_text(json.dumps(plan, indent=1, sort_keys=True) + "\n")
        same = target.exists() and json.loads(target.read_text()) == plan
        print(f"{path.relative_to(ROOT)}: {plan['solver']['status']} {plan['predicted']['iteration_time_s']} s, "
              f"{'matches' if same else 'DIFFERS from'} {target.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
