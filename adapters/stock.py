"""What stock trainers (Megatron-LM, DeepSpeed, torchtitan) need of a plan, or why they cannot run it.

Stock frameworks run one shape everywhere: the same stage count, TP size and
layer split in every replica, the same TP on every stage, and the same
number of microbatches per replica. A plan that differs is refused with what
differs and how to ask for one that does not.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from adapters.registry import ExportError
from adapters.shell_text import inert
from cost_models.device import Device, DeviceIdError, DeviceSpec, device_order, node_of
from wire.schemas import ModelArchitecture, Plan

# ASCII digits only: a plan read from a file is not validated like a request, and a device id is
# written into launch lines, so "3:5\ntouch x" or other scripts' digits never get that far.

ASK_FOR_STOCK = (
    'ask for a plan stock trainers run with "options": {"allow_non_uniform": false}, '
    "or export it with --format torch-csv for PyTorch's pipelining runtime"
)


@dataclass(frozen=True)
class StockLayout:
    tp: int
    pp: int
    dp: int
    virtual_stages: int
    micro_batch_size: int
    num_microbatches: int  # per replica
    global_batch_size: int
    seq_length: int
    layers_per_stage: tuple[int, ...]  # in total per physical stage (all its chunks)
    recompute: str
    zero_stage: int
    precision: str
    schedule: str
    architecture: ModelArchitecture
    rank_devices: tuple[str, ...]  # global rank -> device, Megatron's order: tp fastest, then cp, dp, pp
    gpus_per_node: int
    nodes: tuple[int, ...]
    cp: int = 1  # context-parallel ranks per stage
    ep: int = 1  # expert parallelism: each stage's routed experts split over ep GPUs (`ParallelShape.expert_span`)
    etp: int | None = None  # expert tensor parallelism: each routed expert split over etp GPUs; None: tp
    dp_shard: int | None = None  # replicas of a ZeRO shard group (None: all of them; with ZeRO-0, nothing is sharded)
    grad_precision: str | None = None  # "bf16": gradients accumulate and reduce in bf16; else fp32 (fp16: its own)
    moe_dispatcher: str | None = None  # "flex": DeepEP/HybridEP token dispatch; else the all-to-all
    moe_a2a_overlap: bool = False  # Megatron's batch-level EP overlap hides the all-to-alls
    tp_comm_overlap: str = "none"  # "megatron" (--tp-comm-overlap) or "async_tp" (PyTorch's asynchronous TP)
    # Layers of each model chunk, chunk c of stage s at c * pp + s, when the plan's chunks are uneven (an
    # estimate's layers_per_chunk); None: each stage's layers cut into virtual_stages equal chunks.
    layers_per_chunk: tuple[int, ...] | None = None

    def chunk_layers(self, target: str) -> tuple[int, ...]:
        """Layers of each model chunk in virtual-stage order; ExportError where a stage's layers do not cut
        into virtual_stages equal chunks and the plan names no uneven ones."""
        if self.layers_per_chunk is not None:
            return self.layers_per_chunk
        p, v = self.pp, self.virtual_stages
        for stage, count in enumerate(self.layers_per_stage):
            if count % v:
                raise ExportError(f"{target} cannot run this plan: stage {stage} holds {count} layers, which do not "
                                  f"split into virtual_stages={v} equal chunks")
        return tuple(self.layers_per_stage[part % p] // v for part in range(p * v))

    @property
    def shard_replicas(self) -> int:
        """Replicas sharding the ZeRO state together: 1 with ZeRO-0, else dp_shard or all of them."""
        if self.zero_stage == 0:
            return 1
        return self.dp if self.dp_shard is None else self.dp_shard

    @property
    def shard_groups(self) -> int:
        """Groups holding the same shards (torchtitan's dp_replicate, Megatron's distributed-optimizer instances):
        dp with ZeRO-0, 1 with full sharding, more with hybrid sharding."""
        return self.dp // self.shard_replicas

    @property
    def group_size(self) -> int:
        """Ranks of one stage: tp x cp."""
        return self.tp * self.cp

    @property
    def world_size(self) -> int:
        return self.group_size * self.pp * self.dp

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1

    @property
    def uneven(self) -> bool:
        return len(set(self.layers_per_stage)) > 1


def _differences(plan: Plan) -> list[str]:
    replicas = plan.replicas
    problems = []
    if len({len(r.stages) for r in replicas}) > 1:
        problems.append(f"replicas have different stage counts ({sorted({len(r.stages) for r in replicas})})")
    tps = sorted({s.tp for r in replicas for s in r.stages})
    if len(tps) > 1:
        problems.append(f"stages use different TP sizes ({', '.join(map(str, tps))})")
    cps = sorted({s.cp for r in replicas for s in r.stages})
    if len(cps) > 1:
        problems.append(f"stages use different context-parallel sizes ({', '.join(map(str, cps))})")
    splits = {tuple((tuple(s.layers), tuple(s.chunk_layers or ())) for s in r.stages) for r in replicas}
    if len(splits) > 1:
        problems.append(f"replicas split the layers differently ({len(splits)} different splits)")
    microbatches = sorted({r.num_microbatches for r in replicas})
    if len(microbatches) > 1:
        problems.append(f"replicas run different microbatch counts ({', '.join(map(str, microbatches))})")
    return problems


def _device_id_problems(plan: Plan) -> list[str]:
    """Device ids that are not `<node>:<gpu>` (or `<node>:*` among the excluded)."""
    placed = (device for replica in plan.replicas for stage in replica.stages for device in stage.devices)
    for device in [*placed, *plan.unused_devices]:
        try:
            Device.parse(device)
        except DeviceIdError:
            return [f'device id "{inert(device)}" is not "<node>:<gpu>"']
    for device in plan.excluded_devices:
        try:
            DeviceSpec.parse(device)
        except DeviceIdError:
            return [f'excluded device id "{inert(device)}" is not "<node>:<gpu>" or "<node>:*"']
    return []


def _position_problems(plan: Plan) -> list[str]:
    arch = plan.architecture
    if arch is None or plan.seq_length is None or arch.position_embedding != "learned":
        return []
    if plan.seq_length > (arch.max_position_embeddings or 0):
        return [f"its sequences of {plan.seq_length} tokens are longer than the model's learned position table "
                f"({arch.max_position_embeddings} rows)"]
    return []


def stock_layout(plan: Plan, target: str, schedules: Collection[str] | None = None) -> StockLayout:
    """The plan as one uniform shape, or ExportError naming what `target` cannot run.

    schedules: the plan schedules `target` runs (None: any).
    """
    unrunnable = _device_id_problems(plan) + _position_problems(plan)
    if plan.optimizer_precision == "bf16":
        # Megatron-LM and DeepSpeed keep master weights beside the bf16 model, torchtitan shards fp32 parameters
        # under FSDP2's mixed precision: a plan that counted 4 bytes of optimizer state would run out of memory.
        unrunnable.append("its memory counts no fp32 master weights (training.optimizer_precision bf16), which "
                          f"{target} keeps; plan with optimizer_precision fp32")
    if unrunnable:
        raise ExportError(f"{target} cannot run this plan: {'; '.join(unrunnable)}")
    problems = _differences(plan) + _chunk_problems(plan)
    if schedules is not None and plan.schedule not in schedules:
        allowed = ", ".join(f'"{name}"' for name in sorted(schedules))
        problems.append(
            f'its pipeline schedule "{plan.schedule}" is not one {target} runs (ask with "options": '
            f'{{"schedules": [{allowed}]}})'
        )
    if plan.architecture is None or plan.global_batch_size is None or plan.seq_length is None:
        problems.append("it was stored before plans carried the model architecture and batch; plan it again")
    if problems:
        raise ExportError(f"{target} cannot run this plan: {'; '.join(problems)}; {ASK_FOR_STOCK}")
    replicas = sorted(plan.replicas, key=lambda r: r.id)
    first = replicas[0]
    pp = len(first.stages)
    devices = [d for r in replicas for s in r.stages for d in s.devices]
    devices += list(plan.unused_devices) + list(plan.excluded_devices)
    gpus_per_node = 1 + max(spec.gpu for spec in map(DeviceSpec.parse, devices) if spec.gpu is not None)
    rank_devices = tuple(
        device for stage in range(pp) for replica in replicas for device in replica.stages[stage].devices
    )
    return StockLayout(
        tp=first.stages[0].tp,
        cp=first.stages[0].cp,
        ep=plan.ep,
        etp=plan.etp,
        dp_shard=plan.dp_shard,
        grad_precision=plan.grad_precision,
        moe_dispatcher=plan.moe_dispatcher,
        moe_a2a_overlap=plan.moe_a2a_overlap,
        tp_comm_overlap=plan.tp_comm_overlap or "none",
        pp=pp,
        dp=len(replicas),
        virtual_stages=plan.virtual_stages,
        micro_batch_size=plan.micro_batch_size,
        num_microbatches=first.num_microbatches,
        global_batch_size=plan.global_batch_size,
        seq_length=plan.seq_length,
        layers_per_stage=tuple(s.layers[1] - s.layers[0] for s in first.stages),
        layers_per_chunk=_chunk_order(first.stages, plan.virtual_stages),
        recompute=plan.recompute,
        zero_stage=plan.zero_stage,
        precision=plan.precision or "bf16",
        schedule=plan.schedule,
        architecture=plan.architecture,
        rank_devices=rank_devices,
        gpus_per_node=gpus_per_node,
        nodes=tuple(sorted({node_of(d) for d in rank_devices})),
    )


def _chunk_problems(plan: Plan) -> list[str]:
    """What is wrong with the stages' `chunk_layers` (a plan is the client's data): all stages give them or
    none, virtual_stages positive counts each, summing to the stage's layers."""
    stages = [stage for replica in plan.replicas for stage in replica.stages]
    given = [stage for stage in stages if stage.chunk_layers is not None]
    if not given:
        return []
    if len(given) != len(stages):
        return ["some stages give chunk_layers and others do not"]
    v = plan.virtual_stages
    for stage in given:
        chunks = stage.chunk_layers
        if len(chunks) != v or min(chunks) < 1 or sum(chunks) != stage.layers[1] - stage.layers[0]:
            return [f"stage {stage.id}'s chunk_layers {list(chunks)} are not virtual_stages={v} positive counts "
                    f"summing to its {stage.layers[1] - stage.layers[0]} layers"]
    return []


def _chunk_order(stages: Sequence, virtual_stages: int) -> tuple[int, ...] | None:
    """The stages' uneven `chunk_layers` (checked by `_chunk_problems`) in virtual-stage order (chunk c of
    stage s at c x pp + s), or None."""
    if stages[0].chunk_layers is None:
        return None
    p = len(stages)
    return tuple(stages[part % p].chunk_layers[part // p] for part in range(p * virtual_stages))


def check_replica(plan: Plan, replica_id: int | None) -> None:
    """Stock trainers run every replica alike; a replica id is accepted only if the plan has it."""
    if replica_id is None:
        return
    known = sorted(replica.id for replica in plan.replicas)
    if replica_id not in known:
        raise ExportError(f"plan has no replica {replica_id}; its replicas are {known[0]}..{known[-1]}")


def node_blocks(devices: Sequence[str]) -> list[tuple[int, list[int]]] | None:
    """Consecutive ranks on one node as (node, its GPUs in rank order); None if a node's ranks are split.

    torchrun (and DeepSpeed's launcher) give each node one contiguous block
    of global ranks, so a rank order is launchable exactly when every node
    appears in one run.
    """
    blocks: list[tuple[int, list[int]]] = []
    seen: set[int] = set()  # a set, not a scan of the blocks: 16,384 nodes made that 8 s
    for device in devices:
        node, gpu = device_order(device)
        if blocks and blocks[-1][0] == node:
            blocks[-1][1].append(gpu)
        elif node in seen:
            return None
        else:
            seen.add(node)
            blocks.append((node, [gpu]))
    return blocks


def launch_blocks(layout: StockLayout, launcher: str) -> list[tuple[int, list[int]]]:
    """`node_blocks` of the layout's rank order, or ExportError naming the node whose ranks are split."""
    blocks = node_blocks(layout.rank_devices)
    if blocks is not None:
        return blocks
    ranks_by_node: dict[int, list[int]] = {}
    for rank, device in enumerate(layout.rank_devices):
        ranks_by_node.setdefault(node_of(device), []).append(rank)
    node, ranks = next(
        (node, ranks) for node, ranks in ranks_by_node.items() if ranks != list(range(ranks[0], ranks[0] + len(ranks)))
    )
    raise ExportError(
        f"{launcher} cannot place this plan: node {node} holds ranks {ranks[:4]}..., not one contiguous block; "
        "launchers number ranks node by node"
    )
