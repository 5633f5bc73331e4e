"""Baselines resiplan is compared with, each evaluated with resiplan's own cost model.

Every baseline is `run(problem, healthy=None) -> BaselineResult`, raising
`planner.errors.InfeasibleError` when it finds no layout; `healthy` is
resiplan's uniform plan for the cluster without failures (the layout the
adaptive baselines start from), computed when not given.

- cordon: drop every damaged node, best uniform layout on the rest.
- resihp: ResiHP-style progressive TP -> PP -> DP adaptation of the healthy layout.
- oobleck: Oobleck-style pipeline templates of whole nodes.
- recycle: ReCycle-style rerouting of failed stages' work to data-parallel peers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from benchmarks.baselines import cordon, oobleck, recycle, resihp
from benchmarks.baselines.common import BaselineResult
from planner.problem import PlanningProblem
from planner.result import PlanResult

Baseline = Callable[[PlanningProblem, PlanResult | None], BaselineResult]

BASELINES: Mapping[str, Baseline] = MappingProxyType({
    cordon.NAME: cordon.run,
    resihp.NAME: resihp.run,
    oobleck.NAME: oobleck.run,
    recycle.NAME: recycle.run,
})

__all__ = ["BASELINES", "Baseline", "BaselineResult"]
