"""Where a rank's model state lies, in the coordinates of `migration.transfers`.

Units are the migration model's: 0 the embedding, 1..L the layers, L + 1 the final norm and head.
A tensor's *TP dimension* is the one tensor parallelism splits (dim 0 of column-parallel
projections, the vocab-parallel embedding and the head; dim 1 of row-parallel ones). A part
[lo, hi) of [0, 1) is that slice of the whole tensor, of every tensor of a unit. Norm weights are
replicated inside a TP group but travel as parts of dim 0 like the rest (the transfers' bytes
count them so); a stage re-assembles them over its TP group after a move.

A rank holds its stage's TP slice of the weights ([i/t, (i+1)/t) for TP index i of t) and owns
the optimizer state of the intervals `planner.replan.holdings` gives its device: the whole slice
without ZeRO, its replica's share with ZeRO-1. The executor uses those holdings, the ones the
service plans transfers from, so what it holds is what the transfers assume.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

import torch

from planner.replan.holdings import device_holdings, placed_layout
from wire.schemas import Plan

Interval = tuple[Fraction, Fraction]
_MAX_DENOMINATOR = 1 << 24
ROW_PARALLEL = ("wo.weight", "w2.weight")  # split along dim 1; every other tensor along dim 0


def unit_of_name(name: str, num_layers: int) -> int:
    if name.startswith("layers."):
        return int(name.split(".")[1]) + 1
    return 0 if name.startswith("embed.") else num_layers + 1


def tp_dim(name: str) -> int:
    return 1 if name.endswith(ROW_PARALLEL) else 0


def units_of_transfer(layers: list[int], embedding: bool, head: bool, num_layers: int) -> range:
    """The units of a wire transfer (see `wire.migration.transfer_to_wire`)."""
    first = 0 if embedding else layers[0] + 1
    end = num_layers + 2 if head else layers[1] + 1
    return range(first, end)


@dataclass(frozen=True)
class RankShards:
    """One device's holding in one plan: per unit, its weight slice and optimizer intervals."""

    weights: dict[int, Interval]
    optimizer: dict[int, tuple[Interval, ...]]


def plan_shards(plan: Plan) -> dict[str, RankShards]:
    """Every used device's holding, from the service's own holdings model."""
    shards: dict[str, RankShards] = {}
    for device, holding in device_holdings(placed_layout(plan)).items():
        weights: dict[int, Interval] = {}
        optimizer: dict[int, list[Interval]] = {}
        for block in holding:
            w_lo, w_hi, o_lo, o_hi = (Fraction(x).limit_denominator(_MAX_DENOMINATOR) for x in (
                block.weight_lo, block.weight_hi, block.optimizer_lo, block.optimizer_hi))
            for unit in range(block.first_unit, block.end_unit):
                lo, hi = weights.get(unit, (w_lo, w_hi))
                weights[unit] = (min(lo, w_lo), max(hi, w_hi))
                optimizer.setdefault(unit, []).append((o_lo, o_hi))
        shards[device] = RankShards(weights, {unit: tuple(sorted(parts)) for unit, parts in optimizer.items()})
    return shards


def element_range(interval: Interval, size: int, name: str) -> tuple[int, int]:
    """[lo, hi) of a whole tensor's TP dimension of `size` elements, as element indices."""
    lo, hi = interval[0] * size, interval[1] * size
    if lo.denominator != 1 or hi.denominator != 1:
        raise ValueError(f"{name}: part [{interval[0]}, {interval[1]}) of {size} elements is not whole elements; "
                         f"choose model sizes divisible by the plan's TP and ZeRO shard counts")
    return int(lo), int(hi)


def local_slice(tensor: torch.Tensor, name: str, full_size: int, held: Interval, part: Interval) -> torch.Tensor:
    """The view of `part` (whole-tensor coordinates) in `tensor`, which holds the `held` slice of the TP dim."""
    if not (held[0] <= part[0] <= part[1] <= held[1]):
        raise ValueError(f"{name}: part [{part[0]}, {part[1]}) lies outside the held slice [{held[0]}, {held[1]})")
    dim = tp_dim(name) if tensor.dim() > 1 else 0
    if tensor.shape[dim] == full_size:  # replicated (norms): the tensor is whole
        held = (Fraction(0), Fraction(1))
    start, end = element_range(part, full_size, name)
    offset = element_range((held[0], held[0]), full_size, name)[0]
    return tensor.narrow(dim, start - offset, end - start)


def overlap(a: Interval, b: Interval) -> Interval | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def overlaps(intervals: Iterable[Interval], others: Iterable[Interval]) -> list[Interval]:
    found = []
    for a in intervals:
        for b in others:
            both = overlap(a, b)
            if both is not None:
                found.append(both)
    return found
