"""resiplan against cordon-and-restart, ResiHP, Oobleck and ReCycle on failure scenarios.

    python -m benchmarks.failures            # print the table and summary
    python -m benchmarks.failures --quick    # llama2-13b only (for testing)
    python -m benchmarks.failures --write    # also update BENCHMARKS.md

Every figure is a prediction of resiplan's cost model: the baselines
(`benchmarks/baselines/`) are evaluated with the same stage times, pipeline
formula, gradient sync and optimizer costs. Each resiplan solve runs in a
fresh subprocess (options.time_limit_s = 10), so its wall time is per case;
the baselines run in this process.

Surviving-compute limit: resiplan's throughput on the same cluster without
failures x (sum of GPU speeds, failed = 0) / GPUs. Retention: resiplan's
throughput / that limit, both for the schedules the baselines are priced with
(1F1B, interleaved); reported retention: the same for the default plans'
reported times (every schedule allowed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass

from benchmarks.baselines import BASELINES, BaselineResult
from benchmarks.baselines.common import healthy_plan
from benchmarks.report import load_average
from planner.errors import PlanningError
from planner.problem import PlanningProblem
from wire.convert import to_problem
from wire.schemas import PlanRequest

TIME_LIMIT_S = 10.0
# Models whose plans also search context parallelism (CP groups up to a node) at these 4k sequences, which the
# service's default searches from 16k tokens on: at two and four sequences per GPU a damaged replica gains by
# splitting sequences (issue 19). The 70B models keep the default: searching CP for them too gains up to 6% in
# some scenarios but puts 10 of the 44 256-GPU ones over the 2 s target (max 3.3 s), the search spending its work
# on CP shapes.
CONTEXT_PARALLEL_MODELS = frozenset({"llama2-7b", "llama2-13b"})
MAX_CONTEXT_PARALLEL = 8
# Solve-time targets by cluster size (GPUs): wall seconds, layout search and schedules together.
SOLVE_TARGET_S = {256: 2.0, 4096: 5.0}
# resiplan "loses" only when a baseline is faster by more than this (rounding of reported times).
TOLERANCE = 1e-6


@dataclass(frozen=True)
class Setup:
    """A cluster and a training job; scenarios damage it."""

    nodes: int
    gpu: str
    model: str
    global_batch: int
    seq_length: int

    @property
    def gpus(self) -> int:
        return self.nodes * 8

    @property
    def label(self) -> str:
        return f"{self.gpus:,} x {self.gpu}"


@dataclass(frozen=True)
class Scenario:
    setup: Setup
    label: str
    failed: tuple[str, ...] = ()
    slow: tuple[tuple[str, float], ...] = ()


def _spread(count: int, first: int, stride: int, gpu_offset: int = 0) -> list[str]:
    """Devices on distinct, spread-out nodes: node first + k stride, GPU (k + offset) % 8."""
    return [f"{first + k * stride}:{(k + gpu_offset) % 8}" for k in range(count)]


def _a100_scenarios(setup: Setup) -> list[Scenario]:
    out = [Scenario(setup, f"{n} failed", tuple(_spread(n, 1, 3))) for n in (1, 2, 4, 8)]
    for speed in (0.5, 0.25):
        out += [Scenario(setup, f"{n} slow x{speed}", slow=tuple((d, speed) for d in _spread(n, 1, 3))) for n in (1, 2, 4)]
    out.append(Scenario(setup, "mixed: 2 failed, node 7 down, slow x0.5, x0.3",
                        failed=("1:0", "4:1", "7:*"), slow=(("10:3", 0.5), ("13:4", 0.3))))
    return out


def scenarios(quick: bool = False) -> list[Scenario]:
    models = ["llama2-13b"] if quick else ["llama2-7b", "llama2-13b", "llama2-70b", "qwen2.5-72b"]
    out = [s for model in models for s in _a100_scenarios(Setup(32, "A100-80GB", model, 512, 4096))]
    if quick:
        return out
    out.append(Scenario(Setup(128, "H100-SXM", "llama3-70b", 1024, 8192), "4 failed, 2 slow x0.5",
                        failed=tuple(_spread(4, 1, 31)), slow=tuple((d, 0.5) for d in _spread(2, 16, 53, 4))))
    out.append(Scenario(Setup(512, "H100-SXM", "llama3-405b", 2048, 8192), "8 failed, 4 slow x0.5",
                        failed=tuple(_spread(8, 1, 63)), slow=tuple((d, 0.5) for d in _spread(4, 30, 127, 4))))
    return out


def request_for(setup: Setup, failed: tuple[str, ...] = (), slow: tuple[tuple[str, float], ...] = ()) -> dict:
    cp = {"max_context_parallel": MAX_CONTEXT_PARALLEL} if setup.model in CONTEXT_PARALLEL_MODELS else {}
    return {
        "cluster": {"num_nodes": setup.nodes, "gpus_per_node": 8, "gpu": setup.gpu},
        "failures": {"failed": list(failed), "slow": [{"device": d, "speed": s} for d, s in slow]},
        "model": setup.model,
        "training": {"global_batch_size": setup.global_batch, "seq_length": setup.seq_length},
        "options": {"time_limit_s": TIME_LIMIT_S, **cp},
    }


# resiplan's layout is priced like the baselines', by the 1F1B / interleaved bubble model (its slowest replica's
# pipeline plus the exposed sync and the optimizer step), not by its simulated schedule, which can be faster.
_CHILD = r"""
import json, sys, time
from cost_models.pipeline import pipeline_time_ms
from wire.schemas import PlanRequest
from api.tasks.planning import plan_for
request = PlanRequest.model_validate(json.loads(sys.argv[1]))
started, cpu_started = time.perf_counter(), time.process_time()
plan = plan_for(request)
wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
pipeline_ms = max(pipeline_time_ms([s.forward_ms + s.backward_ms for s in r.stages], r.num_microbatches, plan.virtual_stages)
                  for r in plan.replicas if r.num_microbatches > 0)
tail_ms = 1e3 * (plan.predicted.breakdown.dp_comm_s + plan.predicted.breakdown.optimizer_s)
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "status": plan.solver.status, "gap": plan.solver.gap,
                  "iteration_ms": pipeline_ms + tail_ms, "reported_ms": 1e3 * plan.predicted.iteration_time_s,
                  "uniform": plan.uniform}))
"""


def solve(request: dict) -> dict:
    """resiplan's plan in a fresh process: wall time, solver status and gap, iteration time."""
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(request)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def one_f_one_b_family(request: dict) -> dict:
    """`request` with the schedules the baselines' bubble model prices (1F1B, and interleaved for chunked stages):
    resiplan's layout for that family, priced like theirs."""
    return {**request, "options": {**request["options"], "schedules": ["1f1b", "interleaved"]}}


def tokens_per_s(setup: Setup, iteration_ms: float) -> float:
    return setup.global_batch * setup.seq_length / (iteration_ms / 1e3)


def surviving_fraction(problem: PlanningProblem) -> float:
    """Sum of GPU speeds (failed = 0) over the GPU count."""
    cluster = problem.cluster
    lost = len(cluster.failed) + sum(1.0 - speed for _, speed in cluster.slow)
    return (cluster.total_devices - lost) / cluster.total_devices


def run_baselines(problem: PlanningProblem, healthy) -> dict[str, BaselineResult | None]:
    out: dict[str, BaselineResult | None] = {}
    for name, baseline in BASELINES.items():
        try:
            out[name] = baseline(problem, healthy)
        except PlanningError:
            out[name] = None
    return out


def _tps(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--quick", action="store_true", help="llama2-13b on 256 A100s only")
    args = parser.parse_args(argv)

    names = list(BASELINES)
    header = ("| cluster | model | scenario | resiplan tok/s | " + " | ".join(names) +
              " | limit | retention | reported tok/s | reported retention | solve s | CPU s | solver | >= baselines |")
    lines = [header, "|" + "---|" * 3 + "---:|" * (len(names) + 7) + "---|---|"]
    load_before = load_average()
    print("\n".join(lines), flush=True)

    healthy_cache: dict[Setup, tuple[float, float, object]] = {}
    rows = []
    for scenario in scenarios(args.quick):
        setup = scenario.setup
        if setup not in healthy_cache:
            healthy_request = request_for(setup)
            healthy_cache[setup] = (tokens_per_s(setup, solve(one_f_one_b_family(healthy_request))["iteration_ms"]),
                                    tokens_per_s(setup, solve(healthy_request)["reported_ms"]),
                                    healthy_plan(to_problem(PlanRequest.model_validate(healthy_request))))
        healthy_tps, healthy_reported_tps, healthy = healthy_cache[setup]

        request = request_for(setup, scenario.failed, scenario.slow)
        problem = to_problem(PlanRequest.model_validate(request))
        found = solve(request)
        ours = tokens_per_s(setup, solve(one_f_one_b_family(request))["iteration_ms"])
        baselines = run_baselines(problem, healthy)
        limit = healthy_tps * surviving_fraction(problem)
        reported = tokens_per_s(setup, found["reported_ms"])
        reported_limit = healthy_reported_tps * surviving_fraction(problem)
        beaten_by = {name: r.tokens_per_s / ours - 1 for name, r in baselines.items()
                     if r is not None and r.tokens_per_s > ours * (1 + TOLERANCE)}
        row = {"scenario": scenario, "ours": ours, "limit": limit, "retention": ours / limit, "found": found,
               "reported_retention": reported / reported_limit,
               "baselines": baselines, "beaten_by": beaten_by}
        rows.append(row)
        verdict = "yes" if not beaten_by else "no: " + ", ".join(f"{n} +{m:.1%}" for n, m in beaten_by.items())
        lines.append(
            f"| {setup.label} | {setup.model} | {scenario.label} | {_tps(ours)} | "
            + " | ".join(_tps(r.tokens_per_s if r else None) for r in baselines.values())
            + f" | {_tps(limit)} | {row['retention']:.3f} | {_tps(reported)} | {row['reported_retention']:.3f}"
              f" | {found['wall_s']:.2f} | {found['cpu_s']:.2f} | "
              f"{found['status']} gap {found['gap']:.3g} | {verdict} |"
        )
        print(lines[-1], flush=True)

    summary = _summary(rows) + [f"Machine {load_before} before the first case."]
    print("\n" + "\n".join(summary), flush=True)
    if args.write:
        from benchmarks.report import write_section

        text = "\n".join([_PREAMBLE, "", *lines, "", *summary])
        command = "python -m benchmarks.failures --write" + (" --quick" if args.quick else "")
        write_section("Failure scenarios", command, text)
    return 0


_PREAMBLE = (
    "Predicted tokens/s, all from resiplan's cost model. Baselines (`benchmarks/baselines/`): "
    "cordon = drop every damaged node, best uniform layout on the rest; resihp = ResiHP-style TP -> PP -> DP "
    "adaptation of the healthy layout; oobleck = Oobleck-style whole-node pipeline templates; recycle = "
    "ReCycle-style rerouting of failed stages to data-parallel peers, slow GPUs not adapted to. "
    "limit = healthy throughput x surviving compute (sum of GPU speeds / GPUs); retention = resiplan / limit. "
    "resiplan tok/s, limit and retention are resiplan's plans for the schedules the baselines run "
    "(`options.schedules`: 1f1b, interleaved), priced by the 1F1B / interleaved bubble model as the baselines are; "
    "reported tok/s is the default plan's own `predicted.iteration_time_s` (every schedule allowed, zero-bubble and "
    "CP-SAT ones included, which the search chooses layouts by), and reported retention divides it by the healthy "
    "default plan's reported throughput x surviving compute; solve s, CPU s and solver are the default plan's. "
    "For llama2-7b and llama2-13b every plan may split sequences over up to 8 context-parallel ranks in a node "
    "(`options.max_context_parallel` 8; the service's default searches CP from 16,384 tokens on), failure-aware "
    "plans included, and so may cordon's uniform layouts; the other baselines adapt the healthy layout. The 70B "
    "models keep the default (no CP at 4k): searching it for them gains up to 6% in some scenarios and puts 10 of "
    "the 44 256-GPU ones over 2 s. "
    "Solve time: one fresh process per case, time limit 10 s. On 32 nodes the k-th failed or slow GPU is "
    "GPU k % 8 of node 3k + 1 (mixed: slow GPUs on nodes 10 and 13); on 128 and 512 nodes failed GPUs sit on "
    "nodes 1 + 31k / 1 + 63k, slow ones on 16 + 53k / 30 + 127k."
)


def _summary(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    mean = sum(r["retention"] for r in rows) / len(rows)
    worst = min(rows, key=lambda r: r["retention"])
    worst_reported = min(rows, key=lambda r: r["reported_retention"])
    lost = [r for r in rows if r["beaten_by"]]
    out = [
        f"Mean retention: {mean:.3f} over {len(rows)} scenarios (reported: "
        f"{sum(r['reported_retention'] for r in rows) / len(rows):.3f}).",
        (f"Worst retention: {worst['retention']:.3f} ({worst['scenario'].setup.model}, {worst['scenario'].label}, "
         f"{worst['scenario'].setup.label}); reported: {worst_reported['reported_retention']:.3f} "
         f"({worst_reported['scenario'].setup.model}, {worst_reported['scenario'].label}, "
         f"{worst_reported['scenario'].setup.label})."),
        f"resiplan slower than some baseline: {len(lost)} of {len(rows)} scenarios"
        + (": " + "; ".join(
            f"{r['scenario'].setup.model} {r['scenario'].label} ("
            + ", ".join(f"{n} +{m:.2%}" for n, m in r["beaten_by"].items()) + ")" for r in lost) if lost else "."),
    ]
    by_size: dict[int, list[dict]] = {}
    for r in rows:
        by_size.setdefault(r["scenario"].setup.gpus, []).append(r)
    parts = []
    for gpus, group in by_size.items():
        walls = sorted(r["found"]["wall_s"] for r in group)
        cpus = sorted(r["found"]["cpu_s"] for r in group)
        target = SOLVE_TARGET_S.get(gpus)
        over = f", {sum(w > target for w in walls)} of {len(walls)} over the {target:g} s target" if target else ""
        parts.append(f"{group[0]['scenario'].setup.label}: median {walls[len(walls) // 2]:.2f} s, max {walls[-1]:.2f} s "
                     f"(CPU median {cpus[len(cpus) // 2]:.2f} s, max {cpus[-1]:.2f} s){over}")
    out.append("Solve time (wall): " + "; ".join(parts) + ".")
    return out


if __name__ == "__main__":
    sys.exit(main())
