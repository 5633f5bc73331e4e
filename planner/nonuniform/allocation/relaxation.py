"""Upper bounds on the microbatches an allocation runs within a budget, without CP-SAT.

Two relaxations of the allocation model, for any subset of its templates
(the members) and per-template capacities at one budget:

- counting: every TP group earns at most the best capacity per stage of a
  member using its type, and each damaged node its best partition;
- LP (GLOP): replica and partition counts continuous, the same group supplies.

Both are upper bounds: a budget at which either falls short of N microbatches
is infeasible. One GLOP model per allocation input is re-solved with new
objective coefficients (capacities) and variable bounds (members), so a probe
costs a fraction of a millisecond instead of rebuilding the LP.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from ortools.linear_solver import pywraplp

from planner.nonuniform.allocation.input import AllocationInput

# GLOP's objective is a float: a shortfall smaller than this is rounding.
_LP_TOLERANCE = 1e-6


class CapacityRelaxation:
    """The counting bound and the LP relaxation of one allocation input."""

    def __init__(self, data: AllocationInput) -> None:
        self._data = data
        # Stage types as small integers: the counting bound runs thousands of times per search.
        types = sorted({st for t in data.templates for st in t.stage_types}
                       | {g for ps in data.partitions for p in ps for g in p.groups} | {data.base})
        index = {st: i for i, st in enumerate(types)}
        self._type_count = len(types)
        self._base = index[data.base]
        self._template_types = [
            (len(t.stage_types), tuple(sorted({index[st] for st in t.stage_types}))) for t in data.templates
        ]
        self._class_partitions = [
            (len(c.nodes), [tuple(index[g] for g in p.groups) for p in ps]) for c, ps in zip(data.classes, data.partitions)
        ]
        # Templates using the same groups are one LP column, earning the best capacity among its members: the
        # LP puts all of a column's replicas on its best template anyway.
        columns: dict[tuple, int] = {}
        self._column = [columns.setdefault((t.base_groups, t.degraded), len(columns)) for t in data.templates]
        self._column_usage = list(columns)
        self._lp: pywraplp.Solver | None = None
        self._replicas: list[pywraplp.Variable] = []  # per column
        self._set_to: list[float] = []  # each column's current objective coefficient
        self._open: list[bool] = []  # whether each column's replicas are unbounded

    def may_run(self, capacities: Sequence[int], members: Collection[int]) -> bool:
        """False when a relaxation proves the members cannot run all N microbatches."""
        total = self._data.microbatches
        if self.counting_bound(capacities, members) < total:
            return False
        if self.healthy_template(capacities, members) is not None:
            return True
        return self.lp_bound(capacities, members) >= total - _LP_TOLERANCE

    def counting_bound(self, capacities: Sequence[int], members: Collection[int]) -> float:
        """Most microbatches if every group earned its type's best capacity per stage."""
        per_group = [0.0] * self._type_count
        for k in members:
            if capacities[k] <= 0:
                continue
            stages, types = self._template_types[k]
            share = capacities[k] / stages
            for i in types:
                per_group[i] = max(per_group[i], share)
        bound = self._data.healthy_base_groups * per_group[self._base]
        for nodes, partitions in self._class_partitions:
            bound += nodes * max((sum(per_group[i] for i in groups) for groups in partitions), default=0.0)
        return bound

    def healthy_template(self, capacities: Sequence[int], members: Collection[int]) -> tuple[int, int] | None:
        """(member, replicas) of a base-only member whose replicas on undamaged nodes alone run
        all N microbatches, or None."""
        data = self._data
        for k in members:
            template, capacity = data.templates[k], capacities[k]
            if template.degraded or capacity <= 0:
                continue
            replicas = min(data.healthy_base_groups // len(template.stage_types), data.microbatches)
            if replicas >= data.min_replicas and replicas * capacity >= data.microbatches:
                return k, replicas
        return None

    def lp_bound(self, capacities: Sequence[int], members: Collection[int]) -> float:
        """Most microbatches with replica and partition counts continuous (inf if GLOP fails:
        no proof of infeasibility)."""
        if self._lp is None:
            self._build_lp()
        lp, replicas = self._lp, self._replicas
        best = [-1.0] * len(replicas)  # per column, its members' best capacity; -1: no member
        for k in members:
            column = self._column[k]
            best[column] = max(best[column], float(max(0, capacities[k])))
        objective, set_to, open_ = lp.Objective(), self._set_to, self._open
        for column, coefficient in enumerate(best):
            # Only columns with members may have replicas. (One without capacity at this budget may too: its
            # objective coefficient is 0, so its replicas never raise the optimum.)
            if (coefficient >= 0) != open_[column]:
                open_[column] = coefficient >= 0
                replicas[column].SetUb(self._data.microbatches if open_[column] else 0.0)
            if coefficient >= 0 and coefficient != set_to[column]:
                objective.SetCoefficient(replicas[column], coefficient)
                set_to[column] = coefficient
        if lp.Solve() != pywraplp.Solver.OPTIMAL:
            return float("inf")
        return objective.Value()

    def _build_lp(self) -> None:
        data = self._data
        lp = pywraplp.Solver.CreateSolver("GLOP")
        templates = data.templates
        infinity = lp.infinity()

        # Variables: replicas per column (templates using the same groups; bounds set per probe), nodes of each
        # class per partition.
        usage = self._column_usage
        replicas = [lp.NumVar(0, 0, f"replicas_{k}") for k in range(len(usage))]
        chosen = [[lp.NumVar(0, len(c.nodes), "") for _ in ps] for c, ps in zip(data.classes, data.partitions)]

        # Partitions: every damaged node takes exactly one.
        for ci, c in enumerate(data.classes):
            row = lp.Constraint(len(c.nodes), len(c.nodes))
            for x in chosen[ci]:
                row.SetCoefficient(x, 1)

        # Groups: replicas use no more groups of a type than the nodes form (the healthy
        # nodes' base groups on the right-hand side).
        types = sorted({st for t in templates for st, _ in t.degraded} | {data.base})
        for st in types:
            row = lp.Constraint(-infinity, data.healthy_base_groups if st == data.base else 0)
            for k, (base_groups, degraded) in enumerate(usage):
                needed = base_groups if st == data.base else dict(degraded).get(st, 0)
                if needed:
                    row.SetCoefficient(replicas[k], needed)
            for ci, ps in enumerate(data.partitions):
                for pi, p in enumerate(ps):
                    made = p.groups.count(st)
                    if made:
                        row.SetCoefficient(chosen[ci][pi], -made)

        # Microbatches: every replica runs at least one.
        row = lp.Constraint(-infinity, data.microbatches)
        for x in replicas:
            row.SetCoefficient(x, 1)

        # Objective: the most microbatches; coefficients are set per probe.
        lp.Objective().SetMaximization()
        self._lp, self._replicas = lp, replicas
        self._set_to, self._open = [0.0] * len(usage), [False] * len(usage)
