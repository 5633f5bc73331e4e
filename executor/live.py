"""The closed loop, live: every K steps the job's telemetry goes to `/v1/detect`; a newly slow device
makes the job ask for a replan, which it then applies in place (`migrate.py`) at the next step.

Rank 0 talks to the service (`adapters.client.PlannerClient`); every rank sends it its telemetry of
the window and learns the outcome by one broadcast, so all ranks switch at the same step. The
window holds the current plan's steps only (detection reads the plan's layout), and detection
waits for 3 of them. A device is replanned for once: a later detection of a device already known
slow does not replan again. The replan's failure state is the plan's own (failed and slow devices)
plus the devices detected, at the speeds `/v1/detect` measured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from adapters.client import PlannerClient
from wire.schemas import Plan

MIN_WINDOW_STEPS = 3  # /v1/detect wants at least 3 iterations


@dataclass(frozen=True)
class LiveOptions:
    server: str
    token: str | None = None
    detect_every: int = 4  # steps between detections (and the window's length)
    replan_time_limit_s: float | None = None


class LiveLoop:
    def __init__(self, options: LiveOptions) -> None:
        self.options = options
        self.client: PlannerClient | None = None  # made on whichever rank is 0 (a recovery renumbers ranks)
        self.replanned_for: set[str] = set()

    def due(self, step: int, steps: int) -> bool:
        return (step + 1) % self.options.detect_every == 0 and step + 1 < steps

    def check(self, step: int, plan: Plan, window: list[dict[str, Any]]) -> tuple[Plan | None, list[dict[str, Any]]]:
        """Called by every rank after `step` with its telemetry items of the current plan: the plan to switch to
        at step + 1 (or None) and the events, the same on every rank."""
        items: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(window[-self.options.detect_every:], items, dst=0)
        answer: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                answer[0] = self._decide(step, plan, [item for rank_items in items for item in rank_items])
            except Exception as error:  # noqa: BLE001 - every rank must hear of it, or the others wait forever
                answer[0] = (None, [], f"{type(error).__name__}: {error}")
        dist.broadcast_object_list(answer, src=0)
        plan_json, events, error = answer[0]
        if error:
            raise RuntimeError(f"the live loop failed at step {step}: {error}")
        return (Plan.model_validate_json(plan_json) if plan_json else None), events

    def _decide(self, step: int, plan: Plan, items: list[dict[str, Any]]) -> tuple[str | None, list[dict], str | None]:
        iterations = {item["iteration"] for item in items}
        if len(iterations) < MIN_WINDOW_STEPS:
            return None, [], None
        if self.client is None:
            self.client = PlannerClient(self.options.server, self.options.token)
        began = time.perf_counter()
        found = self.client.detect(plan.plan_id, items)
        detected = {f.device: f.speed for f in found.fail_slow}
        events: list[dict[str, Any]] = [{
            "event": "detection", "step": step, "plan_id": plan.plan_id, "window": sorted(iterations),
            "fail_slow": [f.model_dump(mode="json") for f in found.fail_slow], "fail_stop": found.fail_stop,
            "detect_s": round(time.perf_counter() - began, 6),
        }]
        new = sorted(set(detected) - self.replanned_for)
        if not new:
            return None, events, None
        self.replanned_for |= set(detected)
        slow = {s.device: s.speed for s in plan.slow_devices} | detected
        failures = {"failed": list(plan.excluded_devices),
                    "slow": [{"device": d, "speed": speed} for d, speed in sorted(slow.items())]}
        options = {"time_limit_s": self.options.replan_time_limit_s} if self.options.replan_time_limit_s else None
        began = time.perf_counter()
        replanned = self.client.replan(plan.plan_id, failures, options)
        migration = replanned.migration
        events.append({
            "event": "replan", "step": step, "for_devices": new, "from_plan": plan.plan_id,
            "plan_id": replanned.plan_id, "chosen": migration.chosen if migration else None,
            "predicted_iteration_time_s": replanned.predicted.iteration_time_s,
            "running_plan_iteration_time_s": next((c.iteration_time_s for c in migration.candidates
                                                    if c.name == "keep"), None) if migration else None,
            "plan_bytes_moved": migration.bytes_moved if migration else 0,
            "replan_s": round(time.perf_counter() - began, 6),
        })
        return replanned.model_dump_json(), events, None
