"""What moving a running job from one layout to another costs: bytes and seconds.

Model state is counted per *unit*: 0 is the input embedding, 1..L the
transformer layers, L + 1 the output head. A device holds a shard of a run
of units, the same shard of each: its tensor-parallel slice of the weights
(an interval of [0, 1) of every unit's parameters) and, inside that slice,
its share of the optimizer state (the whole slice without ZeRO; with ZeRO-1
the slice split over the data-parallel replicas). Intervals are an
idealisation of the real shardings (rows or columns of each matrix), and
exact in bytes.

A device moving to a new layout keeps what its old and new shards have in
common and receives the rest. Gradients and activations are rebuilt by the
next iteration and never move. Sources: a device of the same node that held
the piece (NVLink), else the network; state whose every holder has failed
(an optimizer shard under ZeRO-1, say) comes from the last checkpoint.
Transfers run in parallel, so the estimate is the slowest receiver's time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cost_models.device import device_order
from cost_models.memory import OPTIMIZER_BYTES_PER_PARAM
from cost_models.model_spec import ModelSpec

# bf16/fp16 weights; the fp32 master copy is part of the optimizer state.
WEIGHT_BYTES_PER_PARAM = 2.0


@dataclass(frozen=True)
class ShardBlock:
    """Units [first_unit, end_unit), each held as the same weight and optimizer interval."""

    first_unit: int
    end_unit: int
    weight_lo: float
    weight_hi: float
    optimizer_lo: float
    optimizer_hi: float


Holding = tuple[ShardBlock, ...]


@dataclass(frozen=True)
class UnitParams:
    """Parameters per unit: the embedding, num_layers equal layers, the head."""

    num_layers: int
    embedding: float
    per_layer: float
    head: float

    @property
    def head_unit(self) -> int:
        return self.num_layers + 1

    def params(self, first_unit: int, end_unit: int) -> float:
        if end_unit <= first_unit:
            return 0.0
        total = 0.0
        if first_unit <= 0 < end_unit:
            total += self.embedding
        layers = min(end_unit, self.num_layers + 1) - max(first_unit, 1)
        total += max(0, layers) * self.per_layer
        if first_unit <= self.head_unit < end_unit:
            total += self.head
        return total


def unit_params(model: ModelSpec) -> UnitParams:
    return UnitParams(model.num_layers, float(model.embedding_params), float(model.params_per_layer),
                      float(model.head_params))


def _overlap(lo_a: float, hi_a: float, lo_b: float, hi_b: float) -> float:
    return max(0.0, min(hi_a, hi_b) - max(lo_a, lo_b))


def block_bytes(block: ShardBlock, units: UnitParams) -> float:
    params = units.params(block.first_unit, block.end_unit)
    return params * (WEIGHT_BYTES_PER_PARAM * (block.weight_hi - block.weight_lo)
                     + OPTIMIZER_BYTES_PER_PARAM * (block.optimizer_hi - block.optimizer_lo))


def holding_bytes(holding: Holding, units: UnitParams) -> float:
    return sum(block_bytes(block, units) for block in holding)


def common_bytes(a: Holding, b: Holding, units: UnitParams) -> float:
    """Bytes of state both holdings contain (each holding covers a unit at most once)."""
    total = 0.0
    for x in a:
        for y in b:
            params = units.params(max(x.first_unit, y.first_unit), min(x.end_unit, y.end_unit))
            if params:
                total += params * (
                    WEIGHT_BYTES_PER_PARAM * _overlap(x.weight_lo, x.weight_hi, y.weight_lo, y.weight_hi)
                    + OPTIMIZER_BYTES_PER_PARAM
                    * _overlap(x.optimizer_lo, x.optimizer_hi, y.optimizer_lo, y.optimizer_hi)
                )
    return total


def missing_bytes(needed: Holding, held: Holding, units: UnitParams) -> float:
    """Bytes a device must receive to hold `needed` when it holds `held` now."""
    return max(0.0, holding_bytes(needed, units) - common_bytes(needed, held, units))


@dataclass(frozen=True)
class MigrationCost:
    bytes_moved: int
    bytes_from_checkpoint: int
    devices_changed: tuple[str, ...]
    estimated_s: float


def _interval_union_length(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of [lo, hi) covered by the union of `intervals`."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo))
    covered, reach = 0.0, lo
    for a, b in clipped:
        if b > reach:
            covered += b - max(a, reach)
            reach = b
    return covered


def _unit_intervals(holdings: Iterable[Holding], optimizer: bool) -> dict[int, list[tuple[float, float]]]:
    by_unit: dict[int, list[tuple[float, float]]] = {}
    for holding in holdings:
        for block in holding:
            interval = (block.optimizer_lo, block.optimizer_hi) if optimizer else (block.weight_lo, block.weight_hi)
            for unit in range(block.first_unit, block.end_unit):
                by_unit.setdefault(unit, []).append(interval)
    return by_unit


def lost_bytes(lost: Iterable[Holding], surviving: Iterable[Holding], units: UnitParams) -> float:
    """State held only by failed devices: it has to come from the last checkpoint."""
    lost = list(lost)
    if not lost:
        return 0.0
    surviving = list(surviving)
    total = 0.0
    for optimizer, bytes_per_param in ((False, WEIGHT_BYTES_PER_PARAM), (True, OPTIMIZER_BYTES_PER_PARAM)):
        gone = _unit_intervals(lost, optimizer)
        kept = _unit_intervals(surviving, optimizer)
        for unit, intervals in gone.items():
            alive = kept.get(unit, [])
            # Measure of union(gone) minus union(alive), by sweeping the gone intervals' union.
            merged = sorted(intervals)
            lost_length, reach = 0.0, 0.0
            for lo, hi in merged:
                lo = max(lo, reach)
                if hi > lo:
                    lost_length += (hi - lo) - _interval_union_length(alive, lo, hi)
                    reach = hi
            total += lost_length * units.params(unit, unit + 1) * bytes_per_param
    return total


def migration_cost(
    old: Mapping[str, Holding],
    new: Mapping[str, Holding],
    alive: frozenset[str],
    node_of: Mapping[str, int],
    units: UnitParams,
    intra_node_bandwidth_gb_s: float,
    inter_node_bandwidth_gb_s: float,
) -> MigrationCost:
    """Bytes every device of the new layout receives, and the slowest receiver's seconds.

    old: what each device held in the running layout (failed ones included: their state is gone).
    new: what each device of the new layout must hold.
    A piece comes over NVLink when one device of the receiver's node held it (the best single
    such source is credited), else over the network.
    """
    by_node: dict[int, list[Holding]] = {}
    for device, holding in old.items():
        if device in alive:
            by_node.setdefault(node_of[device], []).append(holding)
    moved, slowest_s = 0.0, 0.0
    changed: list[str] = []
    for device, needed in new.items():
        held = old.get(device, ()) if device in alive else ()
        missing = missing_bytes(needed, held, units)
        if missing <= 0.0:
            continue
        local = max((common_bytes(needed, peer, units) for peer in by_node.get(node_of[device], []) if peer is not held),
                    default=0.0)
        intra = min(missing, max(0.0, local - common_bytes(needed, held, units)))
        seconds = intra / (intra_node_bandwidth_gb_s * 1e9) + (missing - intra) / (inter_node_bandwidth_gb_s * 1e9)
        slowest_s = max(slowest_s, seconds)
        moved += missing
    for device in set(old) | set(new):
        if device in alive and old.get(device, ()) != new.get(device, ()):
            changed.append(device)
    from_checkpoint = lost_bytes(
        (h for d, h in old.items() if d not in alive), (h for d, h in old.items() if d in alive), units
    )
    return MigrationCost(
        bytes_moved=round(moved),
        bytes_from_checkpoint=round(from_checkpoint),
        devices_changed=tuple(sorted(changed, key=device_order)),
        estimated_s=slowest_s,
    )
