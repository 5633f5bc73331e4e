"""Break the planner on purpose and watch the oracle fail: each mutation applied to a copy of the tree.

    .venv/bin/python -m tests.oracle.mutations [--write]   # --write: into BENCHMARKS.md
    .venv/bin/python -m tests.oracle.mutations --only TEXT [--write]   # those whose name holds TEXT: --write
                                                                       # replaces or adds their rows

Each mutation narrows what the stock search looks at (the kinds of mistake issue 16 found: micro-batch
sizes cut to powers of two, pipeline lengths dropped, schedules the search does not price, splits it does
not try, slow GPUs placed by a fixed rule), or breaks what a failure-aware plan's report rests on (the stock search beside the bubble-model
ones, simulation floors that are floors). The copy is the working tree as committed (`git worktree` of
HEAD) with one text replacement; the mutation's tests run there, and every mutation must make some fail.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.report import BENCHMARKS_MD, write_section

ROOT = Path(__file__).resolve().parents[2]
ORACLE = "tests/oracle/test_uniform_oracle.py"
FAILURE_AWARE = "tests/planner/test_failure_aware_reported.py"
FLOORS = "tests/planner/test_floor_pieces.py"
PLACED = "tests/oracle/test_placed_oracle.py"
WITNESS = "tests/planner/test_failure_aware_witness.py"
EXPERTS = "tests/oracle/test_expert_parallel_oracle.py"
ZERO = "tests/oracle/test_zero_stage_oracle.py"
DIVE = "tests/planner/test_failure_aware_dive.py"
REPORTED_FLOOR = "tests/schedules/test_reported_floor.py"
PASS_ONE = "tests/planner/test_pass_one_best.py"
IMPROVED_OPS = "tests/schedules/test_improved_ops_cap.py"
NONUNIFORM = "tests/planner/test_nonuniform_brute_force.py"
NONUNIFORM_CP = "tests/planner/test_nonuniform_context_parallel.py"

SECTION = "Oracle mutation runs"

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
    ("failure-aware: the non-uniform searches in best-bound order only (no dive)", "planner/nonuniform/search.py",
     "heapq.heappush(self._dives, (max(lower, front), index, _BOUNDED, outer))",
     "heapq.heappush(self._queue, (max(lower, front), index, _BOUNDED, outer))", (DIVE,)),
    ("failure-aware: only the best-valued candidate gets schedules", "planner/plan.py",
     "    for i in order[:2]:", "    for i in order[:1]:", (DIVE,)),
    ("failure-aware: the runner-up's floor keeps the sync looped BFS can hide", "planner/schedules/for_plan.py",
     "            floor_ms -= max(sync.exposed_ms for sync in spec.grad_sync)", "            floor_ms -= 0.0",
     (REPORTED_FLOOR,)),
    ("failure-aware: pass 1 keeps a non-uniform layout over a better uniform one", "planner/plan.py",
     "    if best_uniform is not None and best_uniform.objective_ms < recost(problem, found.layout).iteration_ms:",
     "    if False:", (PASS_ONE,)),
    ("failure-aware: pass 1 stops 5% short of its bound, not its configured gap", "planner/plan.py",
     "incumbent * (1 - problem.config.bubble_search_gap)", "incumbent * (1 - 0.05)", (PASS_ONE,)),
    ("schedules: CP-SAT asked to improve replicas of any size", "planner/schedules/for_plan.py",
     "        if cp_sat_ops(specs[slowest]) > problem.config.max_improved_ops:", "        if False:", (IMPROVED_OPS,)),
    ("failure-aware: no context parallelism in non-uniform layouts", "planner/nonuniform/search.py",
     "    return [cp for cp in context_parallel_sizes(problem, tp) if tp * cp <= problem.cluster.gpus_per_node]",
     "    return [1]", (NONUNIFORM, NONUNIFORM_CP)),
    ("failure-aware: a damaged node's CP groups take tp GPUs, not tp x cp", "planner/nonuniform/partitions.py",
     "            offset += size * cp", "            offset += size", (NONUNIFORM, NONUNIFORM_CP)),
    ("failure-aware: gradients sync over replicas, not replicas x CP ranks", "planner/nonuniform/templates.py",
     "    ranks = sync_replicas * terms.shape.cp", "    ranks = sync_replicas", (NONUNIFORM, NONUNIFORM_CP)),
    ("forced-slow bound: every stage at the slow speed, not j of them", "planner/uniform/candidates.py",
     "total_compute / (p - slow.stages + slow.stages * slow.speed)", "total_compute / (p * slow.speed)", (PLACED,)),
    ("forced-slow bound: a chunked shape's slow stage counted at speed squared", "planner/uniform/candidates.py",
     "layers // p * layer_compute / slow.speed)", "layers // p * layer_compute / slow.speed ** 2)", (PLACED,)),
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
    parser.add_argument("--only", help="run the mutations whose name holds this text (with --write: replace or add "
                                       "their rows in the table, keeping the others)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch) / "tree"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), "HEAD"], cwd=ROOT, check=True)
        try:
            if not args.only:
                checks = (ORACLE, PLACED, FAILURE_AWARE, FLOORS, WITNESS, DIVE, REPORTED_FLOOR, PASS_ONE)
                rows.append(f"| none (HEAD) | {_run(tree, checks)} |")
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
    if args.write and args.only:
        _write_rows(rows, args.only)
    elif args.write:
        write_section(SECTION, "python -m tests.oracle.mutations --write", body)


def _write_rows(rows: list[str], only: str) -> None:
    """Replace (or add) the rows of the mutations run alone in BENCHMARKS.md's table, keeping the other rows and the
    header of the run that wrote the table, and say which rows were run alone and when."""
    text = BENCHMARKS_MD.read_text()
    section = re.search(rf"^## {SECTION}\n.*?(?=^## |\Z)", text, re.DOTALL | re.MULTILINE)
    if section is None:
        raise SystemExit("BENCHMARKS.md has no mutation table to add rows to: run the whole table with --write")
    lines = section.group(0).rstrip("\n").split("\n")
    table = [i for i, line in enumerate(lines) if line.startswith("| ")]
    for row in rows:
        name = row.split("|")[1].strip()
        found = [i for i in table if lines[i].split("|")[1].strip() == name]
        if found:
            lines[found[0]] = row
        else:
            lines.insert(table[-1] + 1, row)
            table.append(table[-1] + 1)
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    names = "; ".join(row.split("|")[1].strip() for row in rows)
    command = f"python -m tests.oracle.mutations --only {shlex.quote(only)} --write"
    lines.append(f"\nRun alone since (`{command}`, {stamp}): {names}.")
    BENCHMARKS_MD.write_text(text.replace(section.group(0), "\n".join(lines) + "\n\n", 1).rstrip() + "\n")


if __name__ == "__main__":
    main()
