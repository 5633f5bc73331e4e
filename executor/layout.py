"""Which rank runs which device, stage, chunk and layers of a plan; the gradient-sync units."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from cost_models.device import device_order
from executor.model import ModelConfig
from wire.schemas import Plan


def device_key(device: str) -> tuple[int, int]:
    return device_order(device)


@dataclass
class StagePlace:
    replica: int  # index into Layout.replicas
    stage: int
    ranks: list[int]  # the stage's ranks, in the order of its devices; TP shard i is on the i-th lowest
    virtuals: list[int]  # PyTorch stage indices of its chunks
    layer_count: int
    cp: int = 1  # context-parallel ranks: the devices are cp TP groups, TP rank fastest (Megatron's order)

    @property
    def leader(self) -> int:
        return min(self.ranks)

    @property
    def tp(self) -> int:
        return len(self.ranks) // self.cp

    def tp_ranks(self, cp_rank: int) -> list[int]:
        """The TP group of context-parallel rank `cp_rank`."""
        return self.ranks[cp_rank * self.tp:(cp_rank + 1) * self.tp]

    def cp_ranks(self, tp_rank: int) -> list[int]:
        """The context-parallel ranks holding TP shard `tp_rank`."""
        return self.ranks[tp_rank::self.tp]

    def place_of(self, rank: int) -> tuple[int, int]:
        """(TP rank, CP rank) of one of the stage's ranks."""
        cp_rank, tp_rank = divmod(self.ranks.index(rank), self.tp)
        return tp_rank, cp_rank


@dataclass
class Part:
    """One model chunk of one replica: PyTorch's virtual stage `virtual`."""

    replica: int
    stage: int
    chunk: int
    virtual: int
    layers: range
    has_embed: bool
    has_head: bool
    experts: range = range(0)  # the routed experts its layers hold (a mixture of experts; all of them at ep 1)


@dataclass
class ReplicaPlace:
    plan_id: int
    num_microbatches: int
    stages: list[StagePlace]
    parts: list[Part]  # in virtual-stage order
    first_sequence: int  # its slice of the global batch starts here

    @property
    def leaders(self) -> list[int]:
        return [stage.leader for stage in self.stages]


@dataclass
class Layout:
    devices: list[str]  # rank -> device (the world's, which may hold devices the plan does not use)
    replicas: list[ReplicaPlace]
    virtual_stages: int
    micro_batch_size: int
    global_batch_size: int
    num_layers: int
    stage_of_rank: dict[int, StagePlace] = field(default_factory=dict)
    ep: int = 1  # expert-parallel size: ep consecutive replicas split each stage's routed experts

    def expert_rank(self, replica: int) -> int:
        """The block of the routed experts replica `replica` (an index into `replicas`) holds."""
        return replica % self.ep

    def expert_peers(self, replica: int) -> list[int]:
        """The replicas of `replica`'s EP group (its own included)."""
        first = replica - self.expert_rank(replica)
        return list(range(first, first + self.ep))

    @property
    def world(self) -> int:
        return len(self.devices)

    @property
    def used_ranks(self) -> list[int]:
        return sorted(self.stage_of_rank)


def _remap_bounds(bounds: list[int], old: int, new: int) -> list[int]:
    if old == new:
        return bounds
    mapped = [round(b * new / old) for b in bounds]
    if all(a < b for a, b in itertools.pairwise(mapped)):
        return mapped
    raise ValueError(f"cannot shrink the plan's {old} layers to {new}: a stage would hold no layer ({mapped})")


def chunk_sizes(count: int, v: int) -> list[int]:
    return [count // v + (1 if c < count % v else 0) for c in range(v)]


def plan_devices(plan: Plan) -> list[str]:
    """The devices a plan uses, in rank order."""
    return sorted({d for r in plan.replicas for s in r.stages for d in s.devices}, key=device_key)


def world_devices(plans: list[Plan]) -> list[str]:
    """Every device any of the plans uses, in rank order: the world of a run that switches between them."""
    return sorted({d for plan in plans for d in plan_devices(plan)}, key=device_key)


def build_layout(plan: Plan, num_layers: int | None = None, devices: list[str] | None = None) -> Layout:
    """`devices`: the world's devices in rank order (default: the plan's own)."""
    devices = devices or plan_devices(plan)
    rank_of = {device: rank for rank, device in enumerate(devices)}
    missing = sorted(set(plan_devices(plan)) - set(rank_of), key=device_key)
    if missing:
        raise ValueError(f"plan {plan.plan_id} uses devices outside the world: {missing}")
    if plan.zero_stage >= 2:
        raise ValueError(f"plan {plan.plan_id} shards gradients{' and weights' if plan.zero_stage == 3 else ''} "
                         f"(zero_stage {plan.zero_stage}); the reference executor shards optimizer state only "
                         "(zero_stage 0 or 1): run it through the megatron, deepspeed or torchtitan export")
    v = plan.virtual_stages
    ep = plan.ep
    num_experts = plan.architecture.num_experts if plan.architecture is not None else 0
    if ep > 1 and any(stage.cp > 1 or len(stage.devices) > 1 for replica in plan.replicas for stage in replica.stages):
        raise ValueError(f"plan {plan.plan_id} splits experts over ep {ep} with stages of several devices (TP or CP): "
                         "the reference executor runs expert parallelism on single-GPU stages only; run it through "
                         "the megatron or torchtitan export")
    plan_layers = plan.replicas[0].stages[-1].layers[1]
    num_layers = num_layers or plan_layers
    layout_replicas: list[ReplicaPlace] = []
    first_sequence = 0
    for index, replica in enumerate(sorted(plan.replicas, key=lambda r: r.id)):
        bounds = [replica.stages[0].layers[0]] + [stage.layers[1] for stage in replica.stages]
        if bounds[0] != 0 or bounds[-1] != plan_layers or any(
            s.layers[0] != prev.layers[1] for prev, s in itertools.pairwise(replica.stages)
        ):
            raise ValueError(f"replica {replica.id}: stages do not cover layers [0, {plan_layers}) contiguously")
        if num_layers != plan_layers and any(stage.chunk_layers is not None for stage in replica.stages):
            raise ValueError(f"plan {plan.plan_id} cuts its {plan_layers} layers into uneven model chunks "
                             f"(chunk_layers): run it on a {plan_layers}-layer model, not {num_layers}")
        bounds = _remap_bounds(bounds, plan_layers, num_layers)
        p = len(replica.stages)
        for stage in replica.stages:
            # TP shard i lives on the i-th lowest rank (DTensor's mesh order); the migration model puts it on
            # the i-th listed device, so the two must agree.
            if list(stage.devices) != sorted(stage.devices, key=device_key):
                raise ValueError(f"replica {replica.id}: stage devices {stage.devices} are not in device order")
            if len(stage.devices) % stage.cp:
                raise ValueError(f"replica {replica.id}: {len(stage.devices)} stage devices are not cp {stage.cp} "
                                 "TP groups")
            chunks = stage.chunk_layers
            if chunks is not None and (len(chunks) != v or min(chunks) < 1
                                       or sum(chunks) != stage.layers[1] - stage.layers[0]):
                raise ValueError(f"replica {replica.id}: stage {stage.id}'s chunk_layers {list(chunks)} are not "
                                 f"{v} positive counts summing to its {stage.layers[1] - stage.layers[0]} layers")
        stages = [
            StagePlace(index, s, [rank_of[d] for d in stage.devices], [c * p + s for c in range(v)],
                       bounds[s + 1] - bounds[s], stage.cp)
            for s, stage in enumerate(replica.stages)
        ]
        parts: list[Part] = []
        first = 0
        per_rank = num_experts // ep
        experts = range(index % ep * per_rank, (index % ep + 1) * per_rank)
        for virtual in range(p * v):
            s, c = virtual % p, virtual // p
            given = replica.stages[s].chunk_layers
            size = given[c] if given is not None else chunk_sizes(stages[s].layer_count, v)[c]
            parts.append(Part(index, s, c, virtual, range(first, first + size), virtual == 0, virtual == p * v - 1,
                              experts))
            first += size
        layout_replicas.append(ReplicaPlace(replica.id, replica.num_microbatches, stages, parts, first_sequence))
        first_sequence += replica.num_microbatches * plan.micro_batch_size
    gbs = plan.global_batch_size or first_sequence
    if gbs != first_sequence:
        raise ValueError(f"microbatches x micro_batch_size = {first_sequence} sequences, plan says {gbs}")
    for group in range(0, len(layout_replicas), ep) if ep > 1 else ():
        peers = layout_replicas[group:group + ep]
        shapes = {(tuple(len(part.layers) for part in replica.parts), replica.num_microbatches) for replica in peers}
        if len(peers) != ep or len(shapes) > 1:
            raise ValueError(f"plan {plan.plan_id}: the replicas of an EP group of {ep} must split their layers and "
                             "microbatches alike (their experts' all-gathers pair up op by op)")
    layout = Layout(devices, layout_replicas, v, plan.micro_batch_size, gbs, num_layers, ep=ep)
    for replica in layout_replicas:
        for stage in replica.stages:
            for rank in stage.ranks:
                layout.stage_of_rank[rank] = stage
    return layout


def sync_units(cfg: ModelConfig) -> list[str]:
    """Gradient-sync units in their one global order: the embedding, each layer (then each of its routed
    experts, which only the replicas holding it sync), the norm + head."""
    units = ["embed"]
    for i in range(cfg.num_layers):
        units.append(f"layers.{i}")
        if cfg.routed(i):
            units += [f"layers.{i}.experts.{e}" for e in range(cfg.num_experts)]
    return [*units, "head"]


def unit_of(param_name: str) -> str:
    if param_name.startswith("layers."):
        parts = param_name.split(".")
        if parts[2:4] == ["mlp", "experts"]:
            return f"layers.{parts[1]}.experts.{parts[4]}"
        return ".".join(parts[:2])
    return "embed" if param_name.startswith("embed.") else "head"


def part_holds(part: Part, unit: str) -> bool:
    if unit == "embed":
        return part.has_embed
    if unit == "head":
        return part.has_head
    pieces = unit.split(".")
    if int(pieces[1]) not in part.layers:
        return False
    return len(pieces) == 2 or int(pieces[3]) in part.experts


