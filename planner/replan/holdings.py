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
from cost_models.model_spec import ModelSpec


@dataclass(frozen=True)
class PlacedStage:
    devices: tuple[str, ...]
    layers: tuple[int, int]  # half-open, over the transformer layers
    cp: int = 1  # context-parallel ranks: devices are cp TP groups, each holding the stage's weights
    chunk_layers: tuple[int, ...] | None = None  # its model chunks' layers when uneven; None: cut evenly


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
    ep: int = 1  # expert parallelism: each layer's routed experts split over ep GPUs (Megatron's EP size)
    expert_share: float = 0.0  # the routed experts' share of a layer's weights (0: a dense model)
    dp_shard: int | None = None  # replicas of a ZeRO shard group (hybrid sharding); None: all of them
    etp: int | None = None  # expert tensor parallelism: each routed expert split over etp GPUs; None: tp


def placed_layout(result: PlanShape) -> PlacedLayout:
    """From a PlanResult or API.md's Plan."""
    replicas = tuple(
        tuple(PlacedStage(tuple(stage.devices), (stage.layers[0], stage.layers[1]), getattr(stage, "cp", 1),
                          _chunk_layers(stage))
              for stage in replica.stages)
        for replica in sorted(result.replicas, key=lambda r: r.id)
    )
    num_layers = replicas[0][-1].layers[1] if replicas else 0
    return PlacedLayout(replicas, result.virtual_stages, result.zero_stage, num_layers, getattr(result, "ep", 1),
                        _expert_share(getattr(result, "architecture", None)), getattr(result, "dp_shard", None),
                        getattr(result, "etp", None))


def _chunk_layers(stage: StageShape) -> tuple[int, ...] | None:
    chunks = getattr(stage, "chunk_layers", None)
    return tuple(chunks) if chunks is not None else None


def _expert_share(architecture: object) -> float:
    """The routed experts' share of a layer's weights, from a PlanResult's ModelSpec or a wire plan's
    architecture (the same field names); 0 for a dense model or a plan stored without one."""
    if architecture is None or not getattr(architecture, "num_experts", 0):
        return 0.0
    model = architecture if isinstance(architecture, ModelSpec) else ModelSpec(
        **{name: getattr(architecture, name) for name in _SHAPE_FIELDS})
    return model.routed_expert_params_per_layer / model.params_per_layer


# What a layer's weight count reads.
_SHAPE_FIELDS = ("name", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_kv_heads",
                 "vocab_size", "swiglu", "tied_embeddings", "normalization", "qkv_bias", "linear_bias",
                 "num_experts", "experts_per_token", "shared_expert_ffn_hidden_size", "head_dim", "qk_norm",
                 "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "dense_layers", "dense_ffn_hidden_size")


def chunk_layer_runs(layer_counts: Sequence[int], virtual_stages: int,
                     chunk_layers: Sequence[Sequence[int] | None] | None = None) -> list[list[tuple[int, int]]]:
    """Per stage, the layer runs its model chunks hold: chunk c of stage s is virtual stage c*p + s,
    virtual stages hold consecutive layers, and a stage's layers split over its chunks as its
    `chunk_layers` say, else near-evenly (the first chunks take the remainder), as the adapters and the
    reference executor build them."""
    p = len(layer_counts)
    runs: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    first = 0
    for virtual in range(p * virtual_stages):
        stage, chunk = virtual % p, virtual // p
        count = layer_counts[stage]
        given = chunk_layers[stage] if chunk_layers is not None else None
        size = given[chunk] if given is not None else count // virtual_stages + (1 if chunk < count % virtual_stages else 0)
        if size:
            runs[stage].append((first, first + size))
        first += size
    return runs


@dataclass(frozen=True)
class _Region:
    """A share [lo, lo + width) of some units' weights, sliced over TP, of each slice the `block`-th of
    `blocks` (expert parallelism), that sharded over `sharers` (ZeRO)."""

    lo: float
    width: float
    sharers: int
    member: int
    block: int = 0
    blocks: int = 1


def device_holdings(layout: PlacedLayout) -> dict[str, Holding]:
    """Every used device's shards: units 0 (embedding), 1..L (layers), L + 1 (head).

    With ZeRO-1 replica r of R owns, of each T-th of a unit's tensor-parallel dimension (T the
    least common multiple of the layout's TP sizes), the r-th R-th: a device whose TP slice spans
    T/t of those pieces holds its replica's share of each. With equal TP everywhere (T = t) that is
    the r-th R-th of the device's slice; with mixed TP it still covers every piece exactly once
    (splitting each device's slice alone into R would leave pieces nobody holds). ZeRO-3 shards the
    weights the same way: the device holds only its share of them too. Context parallelism's cp ranks
    each hold the stage's weights whole (over TP) and shard ZeRO state with the replicas: the optimizer
    is split over replicas x cp, as Megatron's data-parallel-with-CP group does.

    A mixture of experts' layer is laid out as its replicated weights, [0, 1 - e), then its routed
    experts, [1 - e, 1), e their share (`expert_share`): TP slices first (every expert is sharded over TP,
    so a TP rank's slice holds its part of each expert, in expert order), each slice in ep equal blocks.
    Replica r holds block r mod ep of its TP slice and shards its optimizer state with the replicas
    holding the same block, as megatron-core's expert-data-parallel group does. Changing ep alone then
    keeps a GPU's experts inside what it held. With expert-TP etp below tp the slices are etp's and the
    blocks follow megatron-core's expert rank order (etp fastest, then ep, then expert data parallel, over
    the stage's ranks q = t + tp (c + cp r), TP rank t fastest, then CP rank c, then replica r): GPU q holds
    slice q mod etp of block (q // etp) mod ep and shards its optimizer state with the GPUs of the same
    q // (etp ep) group. Embedding and head are dense.

    Hybrid sharding (`dp_shard` s below the replica count): the ZeRO state is sharded over replicas
    0..s-1, s..2s-1, ... alone, so replica r holds the (r mod s)-th share, as replica r + s does."""
    holdings: dict[str, Holding] = {}
    replicas = len(layout.replicas)
    shard = layout.dp_shard if layout.dp_shard and layout.dp_shard < replicas else replicas
    finest = math.lcm(*(len(stage.devices) // stage.cp for stages in layout.replicas for stage in stages)) if replicas else 1
    share, ep = layout.expert_share, max(1, layout.ep)
    etp = layout.etp
    for index, stages in enumerate(layout.replicas):
        counts = [stage.layers[1] - stage.layers[0] for stage in stages]
        runs = chunk_layer_runs(counts, layout.virtual_stages, [stage.chunk_layers for stage in stages])
        for s, stage in enumerate(stages):
            layer_units = [(first + 1, end + 1) for first, end in runs[s]]
            end_units = ([(0, 1)] if s == 0 else []) + (
                [(layout.num_layers + 1, layout.num_layers + 2)] if s == len(stages) - 1 else [])
            tp = len(stage.devices) // stage.cp
            pieces = finest // tp if layout.zero_stage >= 1 else 1
            expert_tp = tp if etp is None else etp
            for position, device in enumerate(stage.devices):
                cp_rank, rank = divmod(position, tp)
                dense = _Region(0.0, 1.0 - share, shard * stage.cp, index % shard * stage.cp + cp_rank)
                if not share:
                    parts = [(dense, _merged(layer_units + end_units), rank, tp)]
                else:
                    # megatron-core's expert rank order over the stage's ranks (tp, then cp, then replicas)
                    stage_rank = rank + tp * (cp_rank + stage.cp * index)
                    experts = _Region(1.0 - share, share, replicas * stage.cp * tp // (ep * expert_tp),
                                      stage_rank // (expert_tp * ep), stage_rank // expert_tp % ep, ep)
                    parts = [(dense, _merged(layer_units), rank, tp),
                             (experts, _merged(layer_units), rank % expert_tp, expert_tp),
                             (_Region(0.0, 1.0, dense.sharers, dense.member), _merged(end_units), rank, tp)]
                holdings[device] = tuple(block for region, units, slice_rank, slices in parts if units
                                         for block in _region_blocks(region, units, slice_rank, slices, pieces,
                                                                     layout.zero_stage))
    return holdings


def _region_blocks(region: _Region, units: list[tuple[int, int]], rank: int, tp: int, pieces: int,
                   zero_stage: int) -> list[ShardBlock]:
    blocks = []
    held = region.width / (tp * region.blocks)  # of each unit: the device's block of its TP slice
    first_lo = region.lo + region.width * rank / tp + held * region.block
    for piece in range(pieces):
        weight_lo = first_lo + held * piece / pieces
        weight_hi = first_lo + held * (piece + 1) / pieces
        if zero_stage >= 1:
            part = (weight_hi - weight_lo) / region.sharers
            optimizer_lo, optimizer_hi = weight_lo + region.member * part, weight_lo + (region.member + 1) * part
        else:
            optimizer_lo, optimizer_hi = weight_lo, weight_hi
        if zero_stage >= 3:
            weight_lo, weight_hi = optimizer_lo, optimizer_hi
        blocks.extend(ShardBlock(first, end, weight_lo, weight_hi, optimizer_lo, optimizer_hi) for first, end in units)
    return blocks


def _merged(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for first, end in sorted(runs):
        if merged and merged[-1][1] == first:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((first, end))
    return merged
