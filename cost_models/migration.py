"""What moving a running job from one layout to another costs: bytes and seconds.

Model state is counted per *unit*: 0 is the input embedding, 1..L the
transformer layers, L + 1 the output head. A device holds a shard of a run
of units, the same shard of each: its tensor-parallel slice of the weights
(an interval of [0, 1) of every unit's parameters) and, inside that slice,
its share of the optimizer state (the whole slice without ZeRO; with ZeRO-1
its replica's share, `planner.replan.holdings`), as one or more blocks that
never overlap. Intervals are an
idealisation of the real shardings (rows or columns of each matrix), and
exact in bytes.

A device moving to a new layout keeps what its old and new shards have in
common and receives the rest (`transfers.py` says from whom). Gradients and
activations are rebuilt by the next iteration and never move.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.memory import OPTIMIZER_BYTES_PER_PARAM, optimizer_bytes_per_param
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
    """Parameters per unit: the embedding, num_layers equal layers, the head; and the optimizer state's
    bytes a parameter (12 with fp32 master weights, 4 without: `memory.optimizer_bytes_per_param`)."""

    num_layers: int
    embedding: float
    per_layer: float
    head: float
    optimizer_bytes_per_param: float = OPTIMIZER_BYTES_PER_PARAM

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


def unit_params(model: ModelSpec, master_weights: bool = True) -> UnitParams:
    return UnitParams(model.num_layers, float(model.embedding_params), float(model.params_per_layer),
                      float(model.head_params), optimizer_bytes_per_param(master_weights))


def _overlap(lo_a: float, hi_a: float, lo_b: float, hi_b: float) -> float:
    return max(0.0, min(hi_a, hi_b) - max(lo_a, lo_b))


def block_bytes(block: ShardBlock, units: UnitParams) -> float:
    params = units.params(block.first_unit, block.end_unit)
    return params * (WEIGHT_BYTES_PER_PARAM * (block.weight_hi - block.weight_lo)
                     + units.optimizer_bytes_per_param * (block.optimizer_hi - block.optimizer_lo))


def holding_bytes(holding: Holding, units: UnitParams) -> float:
    return sum(block_bytes(block, units) for block in holding)


def common_bytes(a: Holding, b: Holding, units: UnitParams) -> float:
    """Bytes of state both holdings contain (the blocks of one holding never overlap)."""
    total = 0.0
    for x in a:
        for y in b:
            params = units.params(max(x.first_unit, y.first_unit), min(x.end_unit, y.end_unit))
            if params:
                total += params * (
                    WEIGHT_BYTES_PER_PARAM * _overlap(x.weight_lo, x.weight_hi, y.weight_lo, y.weight_hi)
                    + units.optimizer_bytes_per_param
                    * _overlap(x.optimizer_lo, x.optimizer_hi, y.optimizer_lo, y.optimizer_hi)
                )
    return total


def missing_bytes(needed: Holding, held: Holding, units: UnitParams) -> float:
    """Bytes a device must receive to hold `needed` when it holds `held` now."""
    return max(0.0, holding_bytes(needed, units) - common_bytes(needed, held, units))
