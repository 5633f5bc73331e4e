"""What the allocation of one outer choice works on, and its figures in integer ticks.

A template's pipeline price is convex and piecewise affine in its microbatches q: in v-times ticks, a
replica running q microbatches needs the budget max_k (q a_k + c_k) over its pieces (a_k, c_k). Priced
by the bubble model there is one piece, (v M_t, S_t - M_t), the 1F1B formula (q v - 1) M_t + S_t; priced
by simulation floors (`floor_pieces`) there is one per stage. For a pipeline budget P a replica runs at
most cap_t(P) = min_k floor((P - c_k) / a_k) microbatches, and capacities change only at the
breakpoints: the budgets q microbatches need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from planner.config import TIME_QUANTUM_MS
from planner.nonuniform.partitions import NodeClass, Partition, StageType
from planner.nonuniform.templates import Template


def ticks(ms: float) -> int:
    return round(ms / TIME_QUANTUM_MS)


# (slope, offset) pairs in v-times ticks: q microbatches need max(q slope + offset).
Pieces = tuple[tuple[int, int], ...]


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
    priced_pieces: tuple[Pieces, ...] | None = None  # per template; None: the bubble model's (`bubble_pieces`)

    @cached_property
    def pieces(self) -> tuple[Pieces, ...]:
        """Each template's price pieces (see the module docstring)."""
        if self.priced_pieces is not None:
            return self.priced_pieces
        return tuple(bubble_pieces(t, self.virtual_stages) for t in self.templates)

    def most_groups(self) -> int:
        """Every TP group the nodes can form at once (each damaged node its largest partition)."""
        return self.healthy_base_groups + sum(
            len(c.nodes) * max((len(p.groups) for p in ps), default=0) for c, ps in zip(self.classes, self.partitions)
        )


def bubble_pieces(template: Template, v: int) -> Pieces:
    """The 1F1B bubble model's one piece: q microbatches need (q v - 1) M + S."""
    bottleneck, total = ticks(template.bottleneck_ms), ticks(template.total_ms)
    return ((v * bottleneck, total - bottleneck),)


def capacity(pieces: Pieces, budget: int) -> int:
    """Most microbatches one replica priced by `pieces` runs within `budget` (v * ticks)."""
    return max(0, min((budget - offset) // slope for slope, offset in pieces))


def need(pieces: Pieces, microbatches: int) -> int:
    """The budget one replica priced by `pieces` needs for `microbatches`."""
    return max(microbatches * slope + offset for slope, offset in pieces)


def breakpoints_between(pieces_of: list[Pieces], total: int, lowest: float, highest: float) -> list[int]:
    """Budgets q = 1..N microbatches need, of every template priced by `pieces_of`, within
    [lowest, highest), ascending."""
    out: set[int] = set()
    for pieces in pieces_of:
        if len(pieces) == 1:  # the bubble model's: the budgets are an arithmetic series
            out.update(_series_between(*pieces[0], total, lowest, highest))
            continue
        steepest, latest = max(slope for slope, _ in pieces), max(offset for _, offset in pieces)
        # Below this q every piece, so the price, stays under `lowest`.
        first = max(1, int((lowest - latest) // steepest))
        for q in range(first, total + 1):
            budget = need(pieces, q)
            if budget >= highest:
                break
            if budget >= lowest:
                out.add(budget)
    return sorted(out)


def _series_between(slope: int, offset: int, total: int, lowest: float, highest: float) -> range:
    """q slope + offset for q = 1..N, within [lowest, highest)."""
    first = 1 if lowest == -math.inf else max(1, math.ceil((lowest - offset) / slope))
    last = total if highest == math.inf else min(total, math.ceil((highest - offset) / slope) - 1)
    return range(first * slope + offset, last * slope + offset + 1, slope)
