"""CP-SAT model: can a set of templates run all N microbatches within one budget?

Decides which partition each damaged node takes and how many replicas of each
template to build, with every replica's capacity at the budget a constant.
The model is built once per allocation input; a probe only rewrites the
capacity coefficients and the replica domains (zero outside the probed
templates), since building a CpModel costs more than solving these.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from ortools.sat.python import cp_model

from planner.cp_sat import limit_solver, new_solver
from planner.nonuniform.allocation.input import AllocationInput


@dataclass(frozen=True)
class Found:
    """A feasible allocation: replicas per template and, per class, nodes per partition."""

    replicas: tuple[int, ...]
    partition_counts: tuple[tuple[int, ...], ...]


# What a probe that ran out of time reports: neither feasible nor proven infeasible.
UNKNOWN = "unknown"


class FeasibilityModel:
    def __init__(self, data: AllocationInput, random_seed: int) -> None:
        self._data = data
        templates, total = data.templates, data.microbatches
        model = cp_model.CpModel()

        # Data: group supplies per partition; the most replicas each template could have.
        supply = [[p.counts() for p in ps] for ps in data.partitions]
        most_groups = data.most_groups()
        self._most = [min(total, most_groups // len(t.stage_types)) for t in templates]

        # Variables: nodes of each class per partition, replicas per template.
        chosen = [[model.new_int_var(0, len(c.nodes), f"class{ci}_partition{pi}") for pi in range(len(ps))]
                  for ci, (c, ps) in enumerate(zip(data.classes, data.partitions))]
        replicas = [model.new_int_var(0, most, f"replicas_{k}") for k, most in enumerate(self._most)]

        # Partitions: every damaged node takes exactly one.
        for ci, c in enumerate(data.classes):
            model.add(sum(chosen[ci]) == len(c.nodes))

        # Groups: replicas use no more groups of a type than the nodes form.
        for st in sorted({st for t in templates for st, _ in t.degraded}):
            made = sum(chosen[ci][pi] * counts[st] for ci, row in enumerate(supply)
                       for pi, counts in enumerate(row) if counts[st])
            model.add(sum(replicas[k] * t.degraded_map[st] for k, t in enumerate(templates) if st in t.degraded_map) <= made)
        base_made = data.healthy_base_groups + sum(
            chosen[ci][pi] * counts[data.base] for ci, row in enumerate(supply) for pi, counts in enumerate(row)
            if counts[data.base]
        )
        model.add(sum(replicas[k] * t.base_groups for k, t in enumerate(templates)) <= base_made)

        # Microbatches: capacity covers all N (coefficients set per probe); every replica runs at least one.
        cover = model.add(sum(replicas[k] * 1 for k in range(len(templates))) >= total)
        model.add(sum(replicas) <= total)
        model.add(sum(replicas) >= data.min_replicas)

        self._model, self._chosen, self._replicas = model, chosen, replicas
        self._cover = cover.proto.linear
        self._cover_index = {var: i for i, var in enumerate(self._cover.vars)}
        self._variables = model.proto.variables
        # Small models solved many times: presolve and probing cost more than they save.
        self._solver = new_solver(None, random_seed, presolve=False)
        self._solver.parameters.cp_model_probing_level = 0
        self.deterministic_time = 0.0  # CP-SAT's, of the last `solve`

    def solve(self, capacities: Sequence[int], members: Collection[int], time_limit_s: float) -> Found | str | None:
        """An allocation of the members within the budget whose capacities are given; None if
        there is none, UNKNOWN if time ran out first."""
        allowed = set(members)
        for k, variable in enumerate(self._replicas):
            usable = k in allowed and capacities[k] > 0
            self._variables[variable.index].domain[1] = self._most[k] if usable else 0
            self._cover.coeffs[self._cover_index[variable.index]] = capacities[k] if usable else 0
        solver = self._solver
        limit_solver(solver, time_limit_s)
        status = solver.solve(self._model)
        self.deterministic_time = solver.deterministic_time  # the work a budget is charged for the probe
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return Found(
                replicas=tuple(solver.value(r) for r in self._replicas),
                partition_counts=tuple(tuple(solver.value(x) for x in row) for row in self._chosen),
            )
        return None if status == cp_model.INFEASIBLE else UNKNOWN

