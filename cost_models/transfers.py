"""Which device sends which piece of model state to which, when a job moves to a new layout.

State is counted as in `migration.py`: per unit (0 the embedding, 1..L the layers, L + 1 the
head), a device holds an interval of [0, 1) of each unit's tensor-parallel dimension as weights
and an interval as optimizer state (the same one without ZeRO-1; with it, the replica's share of
the weight interval). A receiver needs its new holding; what it held itself stays, every other
piece comes from one device that holds it now:

- a device on the receiver's node if one holds the piece (NVLink), else any holder (network);
- among those, the one with the fewest bytes to send so far, ties in device order, so senders
  share the load; a receiver then takes every piece the same devices hold from that one sender,
  so its pieces come in few, large transfers (receivers are served in device order, pieces in
  unit order: deterministic);
- pieces no alive device holds (say a failed device's ZeRO-1 optimizer shard) come from the
  last checkpoint and are counted apart.

Intervals are exact fractions: tensor-parallel ranks r/t and ZeRO shards split them over d
replicas, so every boundary is a fraction with a denominator dividing t x d.

Time: every device sends and receives at once, NVLink and network links run side by side, and
a link's transfers share its bandwidth; the move takes as long as the busiest link (per device:
bytes sent and received over NVLink by the in-node bandwidth, over the network by the network
share; on a node whose GPUs link directly to each other without a switch, also the bytes between
two GPUs by their one peer link, `layout.nvlink_group_gb_s(hardware, 2)`). This is the time of a perfectly overlapped exchange, a lower bound on what a real
transfer engine achieves.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction

from cost_models.device import device_order
from cost_models.migration import WEIGHT_BYTES_PER_PARAM, Holding, ShardBlock, UnitParams

WEIGHTS, OPTIMIZER = "weights", "optimizer"
# Interval ends are r/t plus multiples of (1/t)/d: no denominator exceeds t x d <= 2^24 here.
_MAX_DENOMINATOR = 1 << 24
_MAX_GRID_DENOMINATOR = 2**62
_FALLBACK_GRID_DENOMINATOR = 2**24 * math.lcm(*range(1, 33))


def _bytes_per_param(kind: str, units: UnitParams) -> float:
    return WEIGHT_BYTES_PER_PARAM if kind == WEIGHTS else units.optimizer_bytes_per_param


@dataclass(frozen=True)
class Transfer:
    """Units [first_unit, end_unit), the part [part_lo, part_hi) of each, of the given states."""

    sender: str
    receiver: str
    first_unit: int
    end_unit: int
    part_lo: Fraction
    part_hi: Fraction
    states: tuple[str, ...]  # "weights", "optimizer" or both
    bytes: float
    intra_node: bool
    receiver_tp_shard: tuple[int, int]  # (rank, tp) of the receiver in its new stage


@dataclass(frozen=True)
class TransferPlan:
    transfers: tuple[Transfer, ...]
    bytes_moved: float  # the transfers' sum
    bytes_from_checkpoint: float  # what receivers need that no alive device holds
    estimated_s: float


class _Grid:
    """Interval ends as integers: multiples of 1/denominator, the least common one of every end (the
    search compares and adds integers, not fractions)."""

    def __init__(self, holdings: Iterable[Holding]) -> None:
        exact: dict[float, Fraction] = {}
        for holding in holdings:
            for block in holding:
                for end in (block.weight_lo, block.weight_hi, block.optimizer_lo, block.optimizer_hi):
                    if end not in exact:
                        exact[end] = Fraction(end).limit_denominator(_MAX_DENOMINATOR)
        self.denominator = math.lcm(1, *(value.denominator for value in exact.values()))
        if self.denominator > _MAX_GRID_DENOMINATOR:
            # Ends that are not small fractions (a mixture of experts' shards cut at the routed experts' float
            # share of a layer) each bring their own denominator, and their least common multiple outgrows any
            # float: round them to a fixed fine grid, where every k/n with n <= 32 still falls on a step.
            self.denominator = _FALLBACK_GRID_DENOMINATOR
            self._steps = {end: round(Fraction(end) * self.denominator) for end in exact}
            return
        self._steps = {end: value.numerator * (self.denominator // value.denominator) for end, value in exact.items()}

    def interval(self, block: ShardBlock, kind: str) -> tuple[int, int]:
        if kind == WEIGHTS:
            return self._steps[block.weight_lo], self._steps[block.weight_hi]
        return self._steps[block.optimizer_lo], self._steps[block.optimizer_hi]


@dataclass(frozen=True)
class _Cell:
    lo: int  # in grid steps
    hi: int
    holders: tuple[str, ...]  # in device order


class _SourceIndex:
    """Per unit and state kind, [0, 1) cut where any holder's interval starts or ends, with the
    devices holding each cell."""

    def __init__(self, held: Mapping[str, Holding], kind: str, grid: _Grid) -> None:
        self._by_unit: dict[int, list[tuple[int, int, str]]] = defaultdict(list)
        for device in sorted(held, key=device_order):
            for block in held[device]:
                lo, hi = grid.interval(block, kind)
                for unit in range(block.first_unit, block.end_unit):
                    self._by_unit[unit].append((lo, hi, device))
        self._whole = grid.denominator
        self._cells: dict[int, tuple[list[int], tuple[_Cell, ...]]] = {}

    def overlapping(self, unit: int, lo: int, hi: int) -> tuple[_Cell, ...]:
        """The unit's cells that meet [lo, hi)."""
        if unit not in self._cells:
            self._cells[unit] = self._build(self._by_unit.get(unit, []), self._whole)
        starts, cells = self._cells[unit]
        first = max(0, bisect_right(starts, lo) - 1)
        return tuple(cell for cell in cells[first:bisect_left(starts, hi)] if cell.hi > lo)

    @staticmethod
    def _build(intervals: list[tuple[int, int, str]], whole: int) -> tuple[list[int], tuple[_Cell, ...]]:
        # Sweep the cuts once, holders entering at their interval's start and leaving at its end:
        # with ZeRO-1 a unit has t x d optimizer intervals, too many to test against every cell.
        starting: dict[int, list[tuple[int, str]]] = defaultdict(list)
        ending: dict[int, list[str]] = defaultdict(list)
        for order, (lo, hi, device) in enumerate(intervals):
            starting[lo].append((order, device))
            ending[hi].append(device)
        cuts = sorted({0, whole} | set(starting) | set(ending))
        active: dict[str, int] = {}
        cells = []
        for a, b in zip(cuts, cuts[1:]):
            for device in ending.get(a, ()):
                active.pop(device, None)
            active.update({device: order for order, device in starting.get(a, ())})
            cells.append(_Cell(a, b, tuple(sorted(active, key=active.__getitem__))))
        return [cell.lo for cell in cells], tuple(cells)


def _tp_shard(holding: Holding, grid: _Grid) -> tuple[int, int]:
    """(rank, tp) of the device holding `holding`: its blocks together span its TP slice."""
    lo = min(grid.interval(block, WEIGHTS)[0] for block in holding)
    hi = max(grid.interval(block, WEIGHTS)[1] for block in holding)
    tp = grid.denominator // (hi - lo)
    return lo // (hi - lo), tp


def plan_transfers(
    old: Mapping[str, Holding],
    new: Mapping[str, Holding],
    alive: frozenset[str],
    node_of: Mapping[str, int],
    units: UnitParams,
    intra_node_bandwidth_gb_s: float,
    inter_node_bandwidth_gb_s: float,
    peer_link_gb_s: float | None = None,
) -> TransferPlan:
    """Every piece the devices of `new` receive, from whom, and how long the exchange takes.

    old: what each device held in the running layout (failed ones included: their state is gone).
    new: what each device of the new layout must hold.
    peer_link_gb_s: the NVLink bandwidth between two GPUs of a node (None: the whole in-node bandwidth,
    as through NVSwitch).
    """
    held = {device: holding for device, holding in old.items() if device in alive}
    grid = _Grid([*held.values(), *new.values()])
    sources = {kind: _SourceIndex(held, kind, grid) for kind in (WEIGHTS, OPTIMIZER)}
    sent: dict[str, float] = defaultdict(float)
    # (receiver, sender, kind, lo, hi) -> units, in the order pieces were chosen.
    pieces: dict[tuple[str, str, str, int, int], list[int]] = defaultdict(list)
    shard_of: dict[str, tuple[int, int]] = {}
    # A receiver keeps the sender it chose for a set of holders: its pieces come in few, large transfers.
    chosen: dict[tuple[str, tuple[str, ...]], str] = {}
    from_checkpoint = 0.0
    for receiver in sorted(new, key=device_order):
        node = node_of[receiver]
        if new[receiver]:
            shard_of[receiver] = _tp_shard(new[receiver], grid)
        for block in new[receiver]:
            for kind in (WEIGHTS, OPTIMIZER):
                lo, hi = grid.interval(block, kind)
                for unit in range(block.first_unit, block.end_unit):
                    unit_bytes = units.params(unit, unit + 1) * _bytes_per_param(kind, units)
                    for cell in sources[kind].overlapping(unit, lo, hi):
                        a, b = max(cell.lo, lo), min(cell.hi, hi)
                        if receiver in cell.holders:
                            continue
                        size = (b - a) / grid.denominator * unit_bytes
                        if not cell.holders:
                            from_checkpoint += size
                            continue
                        candidates = tuple(d for d in cell.holders if node_of[d] == node) or cell.holders
                        sender = chosen.get((receiver, candidates))
                        if sender is None:
                            sender = min(candidates, key=lambda d: sent[d])
                            chosen[(receiver, candidates)] = sender
                        sent[sender] += size
                        pieces[(receiver, sender, kind, a, b)].append(unit)
    transfers = _merged(pieces, units, node_of, shard_of, grid.denominator)
    return TransferPlan(
        transfers=transfers,
        bytes_moved=sum(t.bytes for t in transfers),
        bytes_from_checkpoint=from_checkpoint,
        estimated_s=exchange_seconds(transfers, intra_node_bandwidth_gb_s, inter_node_bandwidth_gb_s, peer_link_gb_s),
    )


def _runs(unit_list: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for unit in sorted(set(unit_list)):
        if runs and runs[-1][1] == unit:
            runs[-1] = (runs[-1][0], unit + 1)
        else:
            runs.append((unit, unit + 1))
    return runs


def _merged(
    pieces: Mapping[tuple[str, str, str, int, int], list[int]],
    units: UnitParams,
    node_of: Mapping[str, int],
    shard_of: Mapping[str, tuple[int, int]],
    denominator: int,
) -> tuple[Transfer, ...]:
    """Pieces joined into transfers: consecutive units of one part, then the parts of a unit run
    that follow each other, then weights and optimizer state of the same run and part."""
    spans: dict[tuple[str, str, str, int, int], list[tuple[int, int]]] = defaultdict(list)
    for (receiver, sender, kind, lo, hi), unit_list in pieces.items():
        for first, end in _runs(unit_list):
            spans[(receiver, sender, kind, first, end)].append((lo, hi))
    states: dict[tuple[str, str, int, int, int, int], list[str]] = defaultdict(list)
    for (receiver, sender, kind, first, end), parts in spans.items():
        joined: list[tuple[int, int]] = []
        for lo, hi in sorted(parts):
            if joined and joined[-1][1] == lo:
                joined[-1] = (joined[-1][0], hi)
            else:
                joined.append((lo, hi))
        for lo, hi in joined:
            states[(receiver, sender, first, end, lo, hi)].append(kind)
    transfers = []
    for (receiver, sender, first, end, lo, hi), kinds in states.items():
        ordered = tuple(kind for kind in (WEIGHTS, OPTIMIZER) if kind in kinds)
        size = units.params(first, end) * (hi - lo) / denominator * sum(_bytes_per_param(kind, units) for kind in ordered)
        transfers.append(Transfer(sender, receiver, first, end, Fraction(lo, denominator), Fraction(hi, denominator),
                                  ordered, size,
                                  node_of[sender] == node_of[receiver], shard_of[receiver]))
    transfers.sort(key=lambda t: (device_order(t.receiver), device_order(t.sender), t.first_unit, t.part_lo))
    return tuple(transfers)


def exchange_seconds(transfers: tuple[Transfer, ...], intra_node_bandwidth_gb_s: float,
                     inter_node_bandwidth_gb_s: float, peer_link_gb_s: float | None = None) -> float:
    """The busiest link's time: each device's sends and receives over NVLink and over the network, and
    each pair's in-node bytes over their peer link (`peer_link_gb_s`; None: through a switch, where a pair
    can use the whole in-node bandwidth and the device's own total binds first)."""
    link_bytes: dict[tuple[str, str, bool], float] = defaultdict(float)
    pair_bytes: dict[tuple[str, str], float] = defaultdict(float)
    for t in transfers:
        link_bytes[(t.sender, "send", t.intra_node)] += t.bytes
        link_bytes[(t.receiver, "receive", t.intra_node)] += t.bytes
        if t.intra_node:
            pair_bytes[(t.sender, t.receiver)] += t.bytes
    device_s = max(
        (size / ((intra_node_bandwidth_gb_s if intra else inter_node_bandwidth_gb_s) * 1e9)
         for (_, _, intra), size in link_bytes.items()),
        default=0.0,
    )
    if peer_link_gb_s is None:
        return device_s
    return max(device_s, max(pair_bytes.values(), default=0.0) / (peer_link_gb_s * 1e9))


@dataclass(frozen=True)
class MigrationCost:
    bytes_moved: int
    bytes_from_checkpoint: int
    devices_changed: tuple[str, ...]
    estimated_s: float
    transfers: tuple[Transfer, ...] = ()


def migration_cost(
    old: Mapping[str, Holding],
    new: Mapping[str, Holding],
    alive: frozenset[str],
    node_of: Mapping[str, int],
    units: UnitParams,
    intra_node_bandwidth_gb_s: float,
    inter_node_bandwidth_gb_s: float,
    peer_link_gb_s: float | None = None,
) -> MigrationCost:
    """`plan_transfers` with the alive devices whose state changes (they receive, shed or leave)."""
    planned = plan_transfers(old, new, alive, node_of, units, intra_node_bandwidth_gb_s, inter_node_bandwidth_gb_s,
                             peer_link_gb_s)
    changed = [device for device in set(old) | set(new) if device in alive and old.get(device, ()) != new.get(device, ())]
    return MigrationCost(
        bytes_moved=round(planned.bytes_moved),
        bytes_from_checkpoint=round(planned.bytes_from_checkpoint),
        devices_changed=tuple(sorted(changed, key=device_order)),
        estimated_s=planned.estimated_s,
        transfers=planned.transfers,
    )
