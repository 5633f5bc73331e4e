"""Closed loop: a simulated training run on 256 GPUs while GPUs fail and slow down.

    python -m benchmarks.closed_loop            # print the tables
    python -m benchmarks.closed_loop --write    # also BENCHMARKS.md and docs/closed-loop.png
                                                # (needs matplotlib: pip install -e '.[bench]')

One run of 1,000 iterations of llama2-13b (global batch 512 x 4,096 tokens)
on 32 x 8 A100-80GB. Fail-stop and fail-slow events arrive at fixed wall-clock
times, the same for every strategy; a strategy that runs longer sees more of
them. Three strategies:

- resiplan: telemetry -> `detect` -> `replan` (migration-aware, amortized
  over 500 iterations) -> migrate in place. Telemetry is synthetic
  (`benchmarks/telemetry.py`: packed variable-length microbatches, noise) and
  the real detector reads it; a fail-slow device is acted on at the iteration
  the detector flags it, with the speed the detector estimates.
- cordon-and-restart: the same detector; every node holding a failed or a
  flagged slow GPU is cordoned for the rest of the run and the job restarts
  on the best uniform layout of the remaining nodes (`allow_non_uniform:
  false`, what stock trainers run).
- static: the healthy plan throughout; a failed GPU is swapped for a spare
  node and the job restarts on the same layout; slow GPUs are not noticed.

Costs (stated, not measured here; change them with the flags):
- a fail-stop of a device in use crashes the iteration in flight, and every
  strategy rolls back to the last checkpoint (every `Costs.checkpoint_every` iterations);
- a job restart (cordon-and-restart, static) costs `Costs.restart_s`: requeue,
  process start, NCCL initialization and checkpoint load;
- an in-place reconfiguration (resiplan) costs `Costs.reconfigure_s` plus the plan's
  `migration.estimated_s`, plus the planner's measured wall time;
- a recovery (a slow GPU back to full speed) is announced by the cluster's
  health checks; resiplan replans, the others carry on.
Iteration times come from the cost model: a plan's predicted time, with each
stage slowed by the ratio of the speed it was planned for to its slowest
device's true speed (1F1B pipeline makespan per replica).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from benchmarks.telemetry import Slowdown, Stop, TelemetryConfig, generate_telemetry
from cost_models.model_spec import model_preset
from cost_models.pipeline import pipeline_time_ms
from detector import layout_from_plan
from detector.detector import RECOMMENDED_WINDOW, decide, summarize
from planner.plan import plan
from planner.problem import PlanningProblem
from planner.replan.choice import ReplanResult, replan, running_plan
from planner.result import PlanResult

MODEL = "llama2-13b"
NUM_NODES, GPUS_PER_NODE = 32, 8
GLOBAL_BATCH, SEQ_LENGTH = 512, 4096
ITERATIONS = 1000
AMORTIZE_ITERATIONS = 500
TIME_LIMIT_S = 10.0
PNG = Path(__file__).resolve().parent.parent / "docs" / "closed-loop.png"


@dataclass(frozen=True)
class Costs:
    restart_s: float = 600.0
    reconfigure_s: float = 60.0
    checkpoint_every: int = 100


@dataclass(frozen=True)
class ClusterEvent:
    at_s: float
    kind: str  # "fail", "slow", "recover"
    device: str  # "n:g", or "n:*" for a whole node (fail only)
    speed: float = 1.0


EVENTS = (
    ClusterEvent(500, "slow", "9:2", 0.5),
    ClusterEvent(1100, "fail", "5:3"),
    ClusterEvent(1600, "slow", "20:4", 0.25),
    ClusterEvent(2200, "fail", "17:*"),
    ClusterEvent(2700, "recover", "20:4"),
    ClusterEvent(3200, "slow", "12:1", 0.7),
    ClusterEvent(3800, "fail", "26:6"),
    ClusterEvent(4400, "slow", "3:0", 0.5),
    ClusterEvent(5000, "fail", "29:*"),
    ClusterEvent(5600, "fail", "8:5"),
    ClusterEvent(6200, "slow", "14:7", 0.5),
)


def _devices(text: str) -> list[str]:
    node, _, gpu = text.partition(":")
    return [f"{node}:{g}" for g in range(GPUS_PER_NODE)] if gpu == "*" else [text]


@dataclass
class Truth:
    """The cluster as it is (what telemetry shows), not as any strategy knows it."""

    failed: set[str] = field(default_factory=set)
    speed: dict[str, float] = field(default_factory=dict)

    def apply(self, event: ClusterEvent) -> None:
        for device in _devices(event.device):
            if event.kind == "fail":
                self.failed.add(device)
            elif event.kind == "slow":
                self.speed[device] = event.speed
            else:
                self.speed.pop(device, None)


def _problem(failed: set[str], slow: dict[str, float], uniform_only: bool) -> PlanningProblem:
    from wire.convert import to_problem
    from wire.schemas import PlanRequest

    return to_problem(PlanRequest.model_validate({
        "cluster": {"num_nodes": NUM_NODES, "gpus_per_node": GPUS_PER_NODE, "gpu": "A100-80GB"},
        "failures": {"failed": sorted(failed), "slow": [{"device": d, "speed": s} for d, s in sorted(slow.items())
                                                        if d not in failed]},
        "model": MODEL,
        "training": {"global_batch_size": GLOBAL_BATCH, "seq_length": SEQ_LENGTH},
        "options": {"time_limit_s": TIME_LIMIT_S, "allow_non_uniform": not uniform_only},
    }))


def used_devices(result: PlanResult) -> set[str]:
    return {d for r in result.replicas for s in r.stages for d in s.devices}


def true_iteration_s(result: PlanResult, truth: Truth) -> float:
    """The plan's predicted iteration with each stage rescaled from its planned speed to its true one."""
    worst_delta_ms = 0.0
    v = result.virtual_stages
    for replica in result.replicas:
        planned = [s.forward_ms + s.backward_ms for s in replica.stages]
        actual = [t * s.speed / min(truth.speed.get(d, 1.0) for d in s.devices) for t, s in zip(planned, replica.stages)]
        delta = pipeline_time_ms(actual, replica.num_microbatches, v) - pipeline_time_ms(planned, replica.num_microbatches, v)
        worst_delta_ms = max(worst_delta_ms, delta)
    return result.predicted.iteration_time_s + worst_delta_ms / 1e3


@dataclass(frozen=True)
class Finding:
    lag_iterations: int  # iterations from the onset until the detector reports the device
    speed: float  # what the detector estimates (1.0 for a fail-stop)


def detect_event(result: PlanResult, device: str, speed: float | None, seed: int) -> Finding:
    """Run the real detector on synthetic telemetry of this plan around the event's onset."""
    model = model_preset(MODEL)
    warmup, horizon = RECOMMENDED_WINDOW, 3 * RECOMMENDED_WINDOW
    config = TelemetryConfig(
        iterations=warmup + horizon, seed=seed, gpu="A100-80GB",
        slowdowns=(Slowdown(device, speed, warmup),) if speed is not None else (),
        stops=(Stop(device, warmup),) if speed is None else (),
    )
    windows = generate_telemetry(result, model, config)
    layout = layout_from_plan(result, model)
    summaries = [summarize(items, layout) for items in windows]
    for t in range(warmup, len(summaries)):
        window = [s for per in summaries[max(0, t - RECOMMENDED_WINDOW + 1): t + 1] for s in per]
        found = decide(window, layout)
        if speed is None and device in found.fail_stop:
            return Finding(t - warmup + 1, 1.0)
        for slow in found.fail_slow:
            if slow.device == device:
                return Finding(t - warmup + 1, slow.speed)
    return Finding(horizon + 1, speed if speed is not None else 1.0)


@dataclass
class Run:
    name: str
    costs: Costs
    time_s: float = 0.0
    done: int = 0
    checkpoint: int = 0
    downtime_s: dict[str, float] = field(default_factory=dict)
    lost_iterations: int = 0
    samples: list[tuple[float, float, int]] = field(default_factory=list)  # (start_s, end_s, iterations done)
    actions: list[str] = field(default_factory=list)

    def pause(self, reason: str, seconds: float) -> None:
        self.samples.append((self.time_s, self.time_s + seconds, 0))
        self.time_s += seconds
        self.downtime_s[reason] = self.downtime_s.get(reason, 0.0) + seconds

    def iterate(self, seconds: float) -> None:
        self.samples.append((self.time_s, self.time_s + seconds, 1))
        self.time_s += seconds
        self.done += 1
        if self.done % self.costs.checkpoint_every == 0:
            self.checkpoint = self.done

    def roll_back(self) -> None:
        self.lost_iterations += self.done - self.checkpoint
        self.done = self.checkpoint


class Planner:
    """Plans and detections, cached (the strategies and the sensitivity reruns meet the same states)."""

    def __init__(self) -> None:
        self._plans: dict[tuple, tuple[PlanResult, float]] = {}
        self._findings: dict[tuple, Finding] = {}
        self._replans: dict[tuple, tuple[ReplanResult, float, PlanResult]] = {}

    def replan(self, failed: set[str], slow: dict[str, float], current: PlanResult) -> tuple[ReplanResult, float]:
        # Results stay referenced by this cache, so id() names a running plan uniquely.
        key = (frozenset(failed), tuple(sorted(slow.items())), id(current))
        if key not in self._replans:
            running = running_plan(current, dict(current.slow_devices))
            started = time.perf_counter()
            found = replan(_problem(failed, slow, uniform_only=False), running, AMORTIZE_ITERATIONS)
            self._replans[key] = (found, time.perf_counter() - started, current)
        found, wall_s, _ = self._replans[key]
        return found, wall_s

    def detect(self, result: PlanResult, device: str, speed: float | None, seed: int) -> Finding:
        key = (id(result), device, speed, seed)
        if key not in self._findings:
            self._findings[key] = detect_event(result, device, speed, seed)
        return self._findings[key]

    def plan(self, failed: set[str], slow: dict[str, float], uniform_only: bool) -> tuple[PlanResult, float]:
        key = (frozenset(failed), tuple(sorted(slow.items())), uniform_only)
        if key not in self._plans:
            started = time.perf_counter()
            result = plan(_problem(failed, slow, uniform_only))
            self._plans[key] = (result, time.perf_counter() - started)
        return self._plans[key]


def _round_speed(speed: float) -> float:
    # Detector estimates carry noise; plans are keyed by them, so two strategies meeting the same
    # slowdown plan for the same speed.
    return max(0.05, min(1.0, round(speed, 2)))


class Strategy:
    name = ""

    def __init__(self, planner: Planner, initial: PlanResult, seed: int) -> None:
        self.planner = planner
        self.current = initial
        self.known_failed: set[str] = set()
        self.known_slow: dict[str, float] = {}
        self.seed = seed

    def on_event(self, run: Run, event: ClusterEvent, truth: Truth, crashed: bool) -> None:
        raise NotImplementedError


class Resiplan(Strategy):
    name = "resiplan"

    def _replan(self, run: Run, reason: str) -> None:
        found, wall_s = self.planner.replan(self.known_failed, self.known_slow, self.current)
        run.pause("planning", wall_s)
        if found.result is not None:
            run.pause("migration", run.costs.reconfigure_s + found.migration.estimated_s)
            self.current = found.result
        run.actions.append(f"{reason}: {found.chosen.name}, {found.migration.bytes_moved / 2**30:.0f} GiB, "
                           f"{found.migration.estimated_s:.1f} s transfer")

    def on_event(self, run: Run, event: ClusterEvent, truth: Truth, crashed: bool) -> None:
        devices = _devices(event.device)
        if event.kind == "fail":
            if crashed:
                lag = self.planner.detect(self.current, devices[0], None, self.seed).lag_iterations
                run.pause("detection", lag * true_iteration_s(self.current, truth))
            self.known_failed.update(devices)
            if crashed or used_devices(self.current) & set(devices):
                self._replan(run, f"fail {event.device}")
        elif event.kind == "slow":
            if event.device not in used_devices(self.current):
                return  # no telemetry from an unused device, and it costs nothing
            finding = self.planner.detect(self.current, event.device, event.speed, self.seed)
            for _ in range(finding.lag_iterations):
                run.iterate(true_iteration_s(self.current, truth))
            self.known_slow[event.device] = _round_speed(finding.speed)
            self._replan(run, f"slow {event.device} (detected {finding.speed:.2f})")
        else:
            if self.known_slow.pop(event.device, None) is not None:
                self._replan(run, f"recover {event.device}")


class CordonAndRestart(Strategy):
    name = "cordon-and-restart"

    def _restart(self, run: Run, node: str, reason: str) -> None:
        self.known_failed.update(_devices(f"{node}:*"))
        self.current, _ = self.planner.plan(self.known_failed, {}, uniform_only=True)
        run.pause("restart", run.costs.restart_s)
        run.actions.append(f"{reason}: cordon node {node}, restart on {len(used_devices(self.current))} GPUs")

    def on_event(self, run: Run, event: ClusterEvent, truth: Truth, crashed: bool) -> None:
        node = event.device.split(":")[0]
        if f"{node}:0" in self.known_failed:
            return  # already cordoned
        if event.kind == "fail":
            if crashed:
                lag = self.planner.detect(self.current, _devices(event.device)[0], None, self.seed).lag_iterations
                run.pause("detection", lag * true_iteration_s(self.current, truth))
                self._restart(run, node, f"fail {event.device}")
            else:
                self.known_failed.update(_devices(f"{node}:*"))
        elif event.kind == "slow" and event.device in used_devices(self.current):
            finding = self.planner.detect(self.current, event.device, event.speed, self.seed)
            for _ in range(finding.lag_iterations):
                run.iterate(true_iteration_s(self.current, truth))
            self._restart(run, node, f"slow {event.device}")


class Static(Strategy):
    name = "static"

    def on_event(self, run: Run, event: ClusterEvent, truth: Truth, crashed: bool) -> None:
        if event.kind == "fail" and crashed:
            for device in _devices(event.device):
                truth.failed.discard(device)  # a spare node takes the failed one's place
            run.pause("restart", run.costs.restart_s)
            run.actions.append(f"fail {event.device}: restart on a spare node, same layout")


def simulate(strategy_type: type[Strategy], planner: Planner, initial: PlanResult, costs: Costs,
             seed: int = 0) -> Run:
    run = Run(strategy_type.name, costs)
    strategy = strategy_type(planner, initial, seed)
    truth = Truth()
    pending = list(EVENTS)
    while run.done < ITERATIONS:
        iteration_s = true_iteration_s(strategy.current, truth)
        if pending and pending[0].at_s <= run.time_s + iteration_s:
            event = pending.pop(0)
            truth.apply(event)
            crashed = event.kind == "fail" and bool(used_devices(strategy.current) & set(_devices(event.device)))
            if crashed:
                run.pause("lost in flight", max(0.0, event.at_s - run.time_s))
                run.roll_back()
            elif event.at_s > run.time_s:
                run.iterate(iteration_s)
            strategy.on_event(run, event, truth, crashed)
            continue
        run.iterate(iteration_s)
    return run


@dataclass(frozen=True)
class Summary:
    name: str
    finish_s: float
    goodput_tokens_s: float
    downtime_s: dict[str, float]
    lost_iterations: int
    actions: tuple[str, ...]


def summarize_run(run: Run) -> Summary:
    tokens = ITERATIONS * GLOBAL_BATCH * SEQ_LENGTH
    return Summary(run.name, run.time_s, tokens / run.time_s, dict(run.downtime_s), run.lost_iterations,
                   tuple(run.actions))


def windowed_goodput(run: Run, window_s: float) -> list[tuple[float, float]]:
    """(window start, tokens/s) of iterations finished inside each window."""
    per_iteration_tokens = GLOBAL_BATCH * SEQ_LENGTH
    count = int(run.time_s // window_s) + 1
    finished = [0] * count
    done = 0
    for _, end, iterations in run.samples:
        done += iterations
        if iterations:
            finished[min(count - 1, int(end // window_s))] += iterations
    return [(i * window_s, finished[i] * per_iteration_tokens / window_s) for i in range(count)]


def plot(runs: Sequence[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(10, 4.2), dpi=110)
    for run, color in zip(runs, ("#1f77b4", "#d62728", "#7f7f7f")):
        points = windowed_goodput(run, 120.0)
        axis.step([t / 60 for t, _ in points], [g / 1e3 for _, g in points], where="post", label=run.name,
                  color=color, linewidth=1.6)
    for event in EVENTS:
        if event.at_s <= max(run.time_s for run in runs):
            axis.axvline(event.at_s / 60, color="#bbbbbb", linewidth=0.8, linestyle=":")
            axis.text(event.at_s / 60, axis.get_ylim()[1] * 0.02, f" {event.kind} {event.device}", rotation=90,
                      fontsize=7, color="#666666", va="bottom")
    axis.set_xlabel("wall-clock time (minutes)")
    axis.set_ylabel("goodput (thousand tokens/s, 2-min windows)")
    axis.set_title(f"{ITERATIONS} iterations of {MODEL} on {NUM_NODES * GPUS_PER_NODE} A100-80GB as GPUs fail and slow down")
    axis.legend(loc="upper right")  # the event labels sit along the bottom
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def _table(summaries: Sequence[Summary], baseline: str) -> str:
    base = next(s for s in summaries if s.name == baseline)
    lines = [("| strategy | finish (min) | goodput (tokens/s) | vs cordon-and-restart | restart / reconfiguration s "
             "| planning s | detection s | lost in flight s | iterations rolled back |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summaries:
        d = s.downtime_s
        lines.append(
            f"| {s.name} | {s.finish_s / 60:.1f} | {s.goodput_tokens_s:,.0f} | {s.goodput_tokens_s / base.goodput_tokens_s:.2f}x "
            f"| {d.get('restart', 0.0) + d.get('migration', 0.0):,.0f} | {d.get('planning', 0.0):.1f} "
            f"| {d.get('detection', 0.0):.1f} | {d.get('lost in flight', 0.0):.1f} | {s.lost_iterations} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="write BENCHMARKS.md and docs/closed-loop.png")
    parser.add_argument("--restart-s", type=float, default=Costs.restart_s)
    parser.add_argument("--reconfigure-s", type=float, default=Costs.reconfigure_s)
    parser.add_argument("--checkpoint-every", type=int, default=Costs.checkpoint_every)
    args = parser.parse_args(argv)
    costs = Costs(args.restart_s, args.reconfigure_s, args.checkpoint_every)
    planner = Planner()
    healthy, _ = planner.plan(set(), {}, uniform_only=False)
    kinds = (Resiplan, CordonAndRestart, Static)
    runs = [simulate(kind, planner, healthy, costs) for kind in kinds]
    summaries = [summarize_run(run) for run in runs]
    body = [_table(summaries, "cordon-and-restart"), ""]
    body.append(f"Healthy iteration: {healthy.predicted.iteration_time_s:.3f} s. Restart {costs.restart_s:.0f} s, "
                f"in-place reconfiguration {costs.reconfigure_s:.0f} s + transfer, checkpoint every "
                f"{costs.checkpoint_every} iterations.")
    body.append("")
    body.append("What each strategy did:\n")
    for s in summaries:
        body.append(f"- **{s.name}**: " + ("; ".join(s.actions) if s.actions else "nothing"))
    body += ["", "Restart cost sensitivity (goodput ratios):", "",
             "| restart s | resiplan / cordon-and-restart | resiplan / static |", "|---:|---:|---:|"]
    for restart_s in (120.0, 300.0, 600.0, 1200.0):
        varied = replace(costs, restart_s=restart_s)
        resiplan_run, cordon, static = (summarize_run(simulate(kind, planner, healthy, varied)) for kind in kinds)
        body.append(f"| {restart_s:.0f} | {resiplan_run.goodput_tokens_s / cordon.goodput_tokens_s:.2f}x "
                    f"| {resiplan_run.goodput_tokens_s / static.goodput_tokens_s:.2f}x |")
    text = "\n".join(body)
    print(text)
    if args.write:
        from benchmarks.report import write_section

        plot(runs, PNG)
        events = ", ".join(f"{e.kind} {e.device}" + (f" ({e.speed})" if e.kind == "slow" else "") + f" at {e.at_s:.0f} s"
                           for e in EVENTS)
        write_section("Closed loop", "python -m benchmarks.closed_loop",
                      f"{ITERATIONS} iterations of {MODEL}, 32 x 8 A100-80GB, global batch {GLOBAL_BATCH} x "
                      f"{SEQ_LENGTH} tokens. Events: {events}. Plot: docs/closed-loop.png.\n\n" + text)


if __name__ == "__main__":
    main()
