"""What the survivors of a lost rank do, in order (see `survival.py` for how they notice and meet)."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from executor import checkpoint
from executor.layout import device_key, plan_devices
from executor.migrate import migrate, switch_events
from executor.model import ModelConfig
from executor.optimizer import AdamState
from executor.runtime import Runtime, build_runtime
from executor.survival import Arrival, Watchdog, ask_replan, join_world, rendezvous, rendezvous_deadline_s, say
from executor.timing import OpTimer
from wire.schemas import Plan


@dataclass
class Progress:
    """Where this rank's optimizer is: the step it runs next, and whether an update is half applied."""

    next_step: int
    torn: bool = False


@dataclass(frozen=True)
class Lost:
    """What a rank knows when a collective fails under it."""

    error: Exception
    watchdog: Watchdog
    runtime: Runtime
    progress: Progress
    step: int  # the step that was running
    step_began: float  # perf_counter() when it began


@dataclass(frozen=True)
class Recovery:
    runtime: Runtime  # the replan's, in the survivors' world
    devices: list[str]  # the survivors: the new world's ranks in order
    next_step: int  # the step to run next (the interrupted one, or a checkpoint's)
    events: list[dict[str, Any]] = field(default_factory=list)


def start_watchdog(root: str, heartbeat_timeout_s: float, devices: list[str]) -> Watchdog:
    """Every rank calls it at the start of a run: one fresh directory per run (rank 0 names it)."""
    name = [f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"]
    dist.broadcast_object_list(name, src=0)
    watchdog = Watchdog(Path(root) / name[0], devices[dist.get_rank()], heartbeat_timeout_s)
    watchdog.watch(0, devices)
    dist.barrier()  # every heartbeat exists before anyone judges them
    return watchdog


def arm_failure(fail_device: tuple[str, int] | None, device: str | None, step: int, runtime: Runtime,
                timer: OpTimer) -> None:
    """`--fail-device DEV@STEP`: DEV's process dies by SIGKILL in STEP, after its first op (its peers are then
    mid-pipeline), or at once if the plan gives it no work."""
    timer.after_op = None
    if fail_device != (device, step):
        return

    def die() -> None:
        say(f"device {device}: killed at step {step} (--fail-device)")
        os.kill(os.getpid(), signal.SIGKILL)  # a lost GPU: no goodbye, no cleanup

    if not runtime.active:
        die()
    timer.after_op = die


def recover(lost: Lost, timeout_s: float, server: str, token: str | None, cfg: ModelConfig, seed: int,
            timer: OpTimer, adam: AdamState | None, checkpoint_dir: str | None) -> Recovery:
    """Meet the other survivors, form their world, get the replan, move the state, and say where to go on."""
    began = time.perf_counter()
    watchdog, old, progress = lost.watchdog, lost.runtime, lost.progress
    why = f"{type(lost.error).__name__}: {str(lost.error)[:300]}"
    watchdog.alarm(why)
    arrival = Arrival(watchdog.device, old.active, progress.next_step, progress.torn, why)
    arrivals = rendezvous(watchdog, arrival, deadline_s=rendezvous_deadline_s(watchdog.timeout_s, timeout_s))
    members = list(arrivals)
    gone = sorted(set(watchdog.members) - set(members), key=device_key)
    if not gone:
        errors = sorted({a.error for a in arrivals.values()})
        raise RuntimeError(f"step {lost.step} failed but every device is still here: {errors}") from lost.error
    join_world(watchdog, members, timeout_s)
    met = time.perf_counter()
    say(f"device {watchdog.device}: lost {gone} during step {lost.step}; {len(members)} devices go on")
    replanned = Plan.model_validate_json(ask_replan(server, token, old.plan, gone))
    replanned_at = time.perf_counter()
    unrun = sorted(set(plan_devices(replanned)) - set(members), key=device_key)
    if unrun:
        raise RuntimeError(f"the replan {replanned.plan_id} uses devices no survivor runs: {unrun}")
    new = build_runtime(replanned, cfg, members, seed, timer, watchdog.epoch, timeout_s)
    regrouped = time.perf_counter()
    event: dict[str, Any] = {
        "event": "recovery", "step": lost.step, "lost": gone, "survivors": len(members),
        "from_plan": old.plan.plan_id, "interrupted_s": round(began - lost.step_began, 6),
        "plan_id": replanned.plan_id, "woken_by": why,
        "rendezvous_s": round(met - began, 6), "replan_s": round(replanned_at - met, 6),
        "regroup_s": round(regrouped - replanned_at, 6)}
    voters = [a for a in arrivals.values() if a.active]
    next_steps = sorted({a.next_step for a in voters})
    problem = None
    if replanned.migration.bytes_from_checkpoint > 0:
        problem = (f"{replanned.migration.bytes_from_checkpoint:,} bytes of the replan's state (e.g. the lost devices' "
                   "ZeRO-1 optimizer shards) were held by no survivor")
    elif len(next_steps) > 1 or any(a.torn for a in voters):
        problem = f"the survivors' states disagree (next steps {next_steps}, an update half applied: " \
                  f"{[a.device for a in voters if a.torn]})"
    if problem is None:
        report = migrate(old, new, replanned.migration.transfers, adam, cfg.num_layers)
        event["transfers_s"] = round(report.transfers_s + report.reassemble_s, 6)
        next_step = next_steps[0] if next_steps else lost.step
        events = switch_events(lost.step, old.plan, replanned, report, regrouped - replanned_at)
    else:
        if not checkpoint_dir:
            raise RuntimeError(f"devices {gone} were lost at step {lost.step}; {problem}, and there is no checkpoint "
                               "to read them from (--checkpoint-every)")
        say(f"{problem}: resuming from the newest checkpoint")
        try:
            step_dir, meta = checkpoint.latest(checkpoint_dir)
        except ValueError as error:
            raise RuntimeError(f"devices {gone} were lost at step {lost.step}; {problem}, and {error}") from None
        loaded_s = checkpoint.load(step_dir, new, adam, cfg.num_layers)
        next_step = meta["next_step"]
        event |= {"from_checkpoint": str(step_dir), "checkpoint_reason": problem, "load_s": round(loaded_s, 6)}
        events = []
    progress.next_step, progress.torn = next_step, False
    event["next_step"] = next_step
    event["total_s"] = round(time.perf_counter() - began, 6)
    return Recovery(new, members, next_step, ([event] if dist.get_rank() == 0 else []) + events)
