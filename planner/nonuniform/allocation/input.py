"""What the allocation of one outer choice works on, and its figures in integer ticks.

For a pipeline budget P (v times the pipeline time, in ticks) a replica of
template t runs at most cap_t(P) = floor((P + M_t - S_t) / (v M_t))
microbatches; capacities change only at the breakpoints (q v - 1) M_t + S_t.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.config import TIME_QUANTUM_MS
from planner.nonuniform.partitions import NodeClass, Partition, StageType
from planner.nonuniform.templates import Template


def ticks(ms: float) -> int:
    return round(ms / TIME_QUANTUM_MS)


@dataclass(frozen=True)
class AllocationInput:
    templates: list[Template]
    base: StageType
    healthy_base_groups: int  # base groups on undamaged nodes
    classes: list[NodeClass]
    partitions: list[list[Partition]]  # per class
    microbatches: int  # N = global batch / micro-batch size
    virtual_stages: int
    min_replicas: int  # ZeRO-1 memory was computed for at least this many replicas

    def most_groups(self) -> int:
        """Every TP group the nodes can form at once (each damaged node its largest partition)."""
        return self.healthy_base_groups + sum(
            len(c.nodes) * max((len(p.groups) for p in ps), default=0) for c, ps in zip(self.classes, self.partitions)
        )


def capacity(template: Template, budget: int, v: int) -> int:
    """Most microbatches one replica of `template` runs within `budget` (v * ticks)."""
    bottleneck, total = ticks(template.bottleneck_ms), ticks(template.total_ms)
    if budget + bottleneck - total < v * bottleneck:
        return 0
    return (budget + bottleneck - total) // (v * bottleneck)


def breakpoints_between(templates: list[Template], v: int, total: int, lowest: float, highest: float) -> list[int]:
    """Budgets (q v - 1) M + S, q = 1..N, of the templates within [lowest, highest), ascending."""
    out: set[int] = set()
    for t in templates:
        bottleneck, fill = ticks(t.bottleneck_ms), ticks(t.total_ms) - ticks(t.bottleneck_ms)
        step = v * bottleneck
        first = 1 if lowest <= step + fill else max(1, int((lowest - fill) // step))
        for q in range(first, total + 1):
            budget = q * step + fill
            if budget >= highest:
                break
            if budget >= lowest:
                out.add(budget)
    return sorted(out)
