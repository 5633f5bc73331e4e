"""The schedule part of a plan: which order each distinct replica runs, and its simulated timeline."""

from __future__ import annotations

from dataclasses import dataclass

from planner.schedules.ops import Schedule
from planner.schedules.simulator import SimulationResult


@dataclass(frozen=True)
class ReplicaTimeline:
    replica_ids: tuple[int, ...]  # replicas with identical stages and microbatches share one timeline
    schedule: Schedule
    simulation: SimulationResult


@dataclass(frozen=True)
class ScheduleChoice:
    name: str  # the slowest replica's schedule
    candidates_ms: tuple[tuple[str, float], ...]  # every schedule tried for the slowest replica
    replicas: tuple[ReplicaTimeline, ...]

    @property
    def slowest(self) -> ReplicaTimeline:
        return max(self.replicas, key=lambda r: r.simulation.makespan_ms)
