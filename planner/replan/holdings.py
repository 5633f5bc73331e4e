"""Which model state each device of a layout holds (for migration costs).

A layout here is only what decides the state a device holds: per replica, its
stages' devices (in tensor-parallel rank order) and layer ranges, the number
of model chunks per stage, and whether ZeRO shards the optimizer state (stages
1-3) and the weights (stage 3) over the replicas; ZeRO-2's sharded gradients
are not state a step carries over. It is built from a planner result or from a stored wire
plan, so a running job's layout and a new one compare alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from cost_models.migration import Holding, ShardBlock


@dataclass(frozen=True)
class PlacedStage:
    devices: tuple[str, ...]
    layers: tuple[int, int]  # half-open, over the transformer layers
    cp: int = 1  # context-parallel ranks: devices are cp TP groups, each holding the stage's weights


class StageShape(Protocol):
    """What placement reads of a stage: a PlanResult's StageResult and a wire Stage both have it."""

    @property
    def devices(self) -> Sequence[str]: ...

    @property
    def layers(self) -> Sequence[int]: ...  # half-open [first, last)


class ReplicaShape(Protocol):
    @property
    def id(self) -> int: ...

    @property
    def stages(self) -> Sequence[StageShape]: ...


class PlanShape(Protocol):
    """The layout part of a plan, as a PlanResult and API.md's Plan (wire.schemas.Plan) both carry it; the
    planner reads stored plans through this, never through the wire models it must not import."""

    @property
    def replicas(self) -> Sequence[ReplicaShape]: ...

    @property
    def virtual_stages(self) -> int: ...

    @property
    def zero_stage(self) -> int: ...


@dataclass(frozen=True)
class PlacedLayout:
    replicas: tuple[tuple[PlacedStage, ...], ...]
    virtual_stages: int
    zero_stage: int
    num_layers: int


def placed_layout(result: PlanShape) -> PlacedLayout:
    """From a PlanResult or API.md's Plan."""
    replicas = tuple(
        tuple(PlacedStage(tuple(stage.devices), (stage.layers[0], stage.layers[1]), getattr(stage, "cp", 1))
              for stage in replica.stages)
        for replica in sorted(result.replicas, key=lambda r: r.id)
    )
    num_layers = replicas[0][-1].layers[1] if replicas else 0
    return PlacedLayout(replicas, result.virtual_stages, result.zero_stage, num_layers)


def chunk_layer_runs(layer_counts: Sequence[int], virtual_stages: int) -> list[list[tuple[int, int]]]:
    """Per stage, the layer runs its model chunks hold: chunk c of stage s is virtual stage c*p + s,
    virtual stages hold consecutive layers, and a stage's layers split over its chunks near-evenly
    (the first chunks take the remainder), as the adapters and the reference executor build them."""
    p = len(layer_counts)
    runs: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    first = 0
    for virtual in range(p * virtual_stages):
        stage, chunk = virtual % p, virtual // p
        count = layer_counts[stage]
        size = count // virtual_stages + (1 if chunk < count % virtual_stages else 0)
        if size:
            runs[stage].append((first, first + size))
        first += size
    return runs


def device_holdings(layout: PlacedLayout) -> dict[str, Holding]:
    """Every used device's shards: units 0 (embedding), 1..L (layers), L + 1 (head).

    With ZeRO-1 replica r of R owns, of each T-th of a unit's tensor-parallel dimension (T the
    least common multiple of the layout's TP sizes), the r-th R-th: a device whose TP slice spans
    T/t of those pieces holds its replica's share of each. With equal TP everywhere (T = t) that is
    the r-th R-th of the device's slice; with mixed TP it still covers every piece exactly once
    (splitting each device's slice alone into R would leave pieces nobody holds). ZeRO-3 shards the
    weights the same way: the device holds only its share of them too. Context parallelism's cp ranks
    each hold the stage's weights whole (over TP) and shard ZeRO state with the replicas: the optimizer
    is split over replicas x cp, as Megatron's data-parallel-with-CP group does."""
    holdings: dict[str, Holding] = {}
    replicas = len(layout.replicas)
    finest = math.lcm(*(len(stage.devices) // stage.cp for stages in layout.replicas for stage in stages)) if replicas else 1
    for index, stages in enumerate(layout.replicas):
        counts = [stage.layers[1] - stage.layers[0] for stage in stages]
        runs = chunk_layer_runs(counts, layout.virtual_stages)
        for s, stage in enumerate(stages):
            units = [(first + 1, end + 1) for first, end in runs[s]]
            if s == 0:
                units.append((0, 1))
            if s == len(stages) - 1:
                units.append((layout.num_layers + 1, layout.num_layers + 2))
            tp = len(stage.devices) // stage.cp
            pieces = finest // tp if layout.zero_stage >= 1 else 1
            sharers = replicas * stage.cp
            for position, device in enumerate(stage.devices):
                cp_rank, rank = divmod(position, tp)
                member = index * stage.cp + cp_rank
                blocks = []
                for piece in range(pieces):
                    weight_lo = rank / tp + piece / (tp * pieces)
                    weight_hi = rank / tp + (piece + 1) / (tp * pieces)
                    if layout.zero_stage >= 1:
                        share = (weight_hi - weight_lo) / sharers
                        optimizer_lo, optimizer_hi = weight_lo + member * share, weight_lo + (member + 1) * share
                    else:
                        optimizer_lo, optimizer_hi = weight_lo, weight_hi
                    if layout.zero_stage >= 3:
                        weight_lo, weight_hi = optimizer_lo, optimizer_hi
                    blocks.extend(ShardBlock(first, end, weight_lo, weight_hi, optimizer_lo, optimizer_hi)
                                  for first, end in _merged(units))
                holdings[device] = tuple(blocks)
    return holdings


def _merged(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for first, end in sorted(runs):
        if merged and merged[-1][1] == first:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((first, end))
    return merged
