"""Break the planner on purpose and watch the oracle fail: each mutation applied to a copy of the tree.

    .venv/bin/python -m tests.oracle.mutations [--write]   # --write: into BENCHMARKS.md

Each mutation narrows what the stock search looks at (the kinds of mistake issue 16 found: micro-batch
sizes cut to powers of two, pipeline lengths dropped, schedules the search does not price, splits it does
not try, slow GPUs placed by a fixed rule), or breaks what a failure-aware plan's report rests on (the stock search beside the bubble-model
ones, simulation floors that are floors). The copy is the working tree as committed (`git worktree` of
HEAD) with one text replacement; the mutation's tests run there, and every mutation must make some fail.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.report import write_section

ROOT = Path(__file__).resolve().parents[2]
ORACLE = "tests/oracle/test_uniform_oracle.py"
FAILURE_AWARE = "tests/planner/test_failure_aware_reported.py"
FLOORS = "tests/planner/test_floor_pieces.py"
PLACED = "tests/oracle/test_placed_oracle.py"
WITNESS = "tests/planner/test_failure_aware_witness.py"
EXPERTS = "tests/oracle/test_expert_parallel_oracle.py"
ZERO = "tests/oracle/test_zero_stage_oracle.py"
DIVE = "tests/planner/test_failure_aware_dive.py"

# (name, file, text, replacement[, tests]); tests default to the uniform oracle.
MUTATIONS = [
    ("micro-batch sizes only 1, 2, 4, 8", "planner/config.py",
     "micro_batch_sizes: tuple[int, ...] | None = None", "micro_batch_sizes: tuple[int, ...] | None = (1, 2, 4, 8)"),
    ("only the longest pipeline per shape", "planner/uniform/candidates.py",
     "for pp in range(min(layers, inventory.total // dp), 0, -1):",
     "for pp in range(min(layers, inventory.total // dp), min(layers, inventory.total // dp) - 1, -1):"),
    ("the search prices 1F1B only", "planner/uniform/simulated.py",
     "self._names = allowed  # None: every schedule", "self._names = frozenset({'1f1b'})"),
    ("only the first stock split of each shape", "planner/uniform/simulated.py",
     "for split in stock_splits(problem.workload.model.num_layers, shape.pp, caps, shape.virtual_stages)]",
     "for split in list(stock_splits(problem.workload.model.num_layers, shape.pp, caps, shape.virtual_stages))[:1]]"),
    ("slow GPUs always packed into the fewest replicas", "planner/uniform/placements.py",
     "        return all_placements(speeds, pp, dp), True", "        return [packed(speeds, pp, dp)], True", (PLACED,)),
    ("slow GPUs always spread one per replica", "planner/uniform/placements.py",
     "        return all_placements(speeds, pp, dp), True", "        return [spread(speeds, pp, dp)], True", (PLACED,)),
    ("stock placements not checked for a launch order", "planner/uniform/simulated.py",
     "        if self._launchable(index, placement):", "        if True:", (PLACED,)),
    ("failure-aware: no stock search beside the bubble-model ones", "planner/plan.py",
     "        candidates.append((stock.best_ms, assemble_plan(problem, found[0])))", "        pass",
     (FAILURE_AWARE, ORACLE)),
    ("failure-aware: the floor search priced by the bubble model", "planner/nonuniform/search.py",
     "        if self._value_of is None:\n            return None\n        out = []",
     "        if True:\n            return None\n        out = []", (FAILURE_AWARE, WITNESS, ORACLE)),
    ("no expert parallelism in the search", "planner/uniform/candidates.py",
     "experts = expert_layouts(problem.workload.model, tp, dp, problem.max_expert_parallel, cp)",
     "experts = [(1, None)]", (EXPERTS,)),
    ("no expert parallelism with context parallelism in the search", "cost_models/expert_parallel.py",
     "    if not model.is_moe:\n        return [(1, None)]\n    out: list",
     "    if not model.is_moe or cp > 1:\n        return [(1, None)]\n    out: list", (EXPERTS,)),
    ("no expert-TP 1 in the search (experts always split over TP)", "cost_models/expert_parallel.py",
     "    for etp in ((tp, 1) if tp > 1 else (tp,)):", "    for etp in (tp,):", (EXPERTS,)),
    ("no hybrid sharding in the search", "planner/uniform/candidates.py",
     "    return (None,) if node is None else (None, node)", "    return (None,)", (ZERO,)),
    ("failure-aware: the floor search in best-bound order only (no dive)", "planner/nonuniform/search.py",
     "heapq.heappush(self._dives if self._value_of is not None else self._queue,", "heapq.heappush(self._queue,",
     (DIVE,)),
    ("failure-aware: only the best-valued candidate gets schedules", "planner/plan.py",
     "    for i in order[:2]:", "    for i in order[:1]:", (DIVE,)),
    ("floors count the backward chain under zero-bubble schedules", "planner/nonuniform/templates.py",
     "before = sum(forwards[:s]) + (sum(backwards[:s]) if full_backward else 0.0)",
     "before = sum(forwards[:s]) + sum(backwards[:s])", (FLOORS, FAILURE_AWARE, ORACLE)),
]


def _run(tree: Path, tests: tuple[str, ...]) -> str:
    out = subprocess.run([sys.executable, "-m", "pytest", "--tb=no", "-rN", "-p", "no:cacheprovider", *tests],
                         cwd=tree, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tree)})
    result = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr.strip()[-200:]
    return f"{', '.join(Path(test).name for test in tests)}: {result}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    parser.add_argument("--only", help="run the mutations whose name holds this text (no --write)")
    args = parser.parse_args()
    if args.only and args.write:
        parser.error("--only runs part of the table: it cannot --write it")
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch) / "tree"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), "HEAD"], cwd=ROOT, check=True)
        try:
            if not args.only:
                rows.append(f"| none (HEAD) | {_run(tree, (ORACLE, PLACED, FAILURE_AWARE, FLOORS, WITNESS, DIVE))} |")
                print(rows[-1], flush=True)
            for name, file, text, replacement, *tests in MUTATIONS:
                if args.only and args.only not in name:
                    continue
                path = tree / file
                original = path.read_text()
                if text not in original:
                    raise SystemExit(f"mutation {name!r}: {file} no longer holds {text!r}")
                path.write_text(original.replace(text, replacement))
                rows.append(f"| {name} | {_run(tree, tests[0] if tests else (ORACLE,))} |")
                print(rows[-1], flush=True)
                path.write_text(original)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=True)
    body = ("The oracle and checking tests on a copy of HEAD, unchanged and with one mutation each "
            "(`tests/oracle/mutations.py` lists them and which tests each runs); every mutation should fail some, "
            "and one that passes everything is a gap in the tests, kept in the table until a test catches it.\n\n"
            "| mutation | tests run: result |\n|---|---|\n" + "\n".join(rows))
    print(body)
    if args.write:
        write_section("Oracle mutation runs", "python -m tests.oracle.mutations --write", body)


if __name__ == "__main__":
    main()
