"""One plan's runtime on one rank: its process groups, model chunks, pipeline schedule and shards."""

from __future__ import annotations

import csv
import io
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from fractions import Fraction
from pathlib import Path

import torch
import torch.distributed as dist

from adapters import torch_csv
from executor.layout import Layout, ReplicaPlace, StagePlace, build_layout, part_holds, sync_units
from executor.model import Chunk, ContextParallel, ExpertParallel, ModelConfig, loss_fn, tp_plan
from executor.shards import Interval, RankShards, plan_shards
from executor.tensor_parallel import Follower, LeaderChunk
from executor.timing import OP_WORK, OpTimer
from wire.schemas import Plan


@dataclass
class Groups:
    plan: dist.ProcessGroup | None  # the plan's ranks (None: the whole world)
    stage: dict[tuple[int, int], dist.ProcessGroup]  # (replica index, stage) -> its ranks, more than one only
    # (replica index, stage, CP rank) -> that CP rank's TP group, tp > 1 only (the stage group when cp is 1)
    tp: dict[tuple[int, int, int], dist.ProcessGroup]
    cp: dict[tuple[int, int, int], dist.ProcessGroup]  # (replica index, stage, TP rank) -> its CP group, cp > 1
    ep: dict[tuple[int, int], dist.ProcessGroup]  # (replica index, stage) -> its EP group's stage ranks, ep > 1
    pp: dict[int, dist.ProcessGroup]  # replica index -> leaders' group
    sync: dict[tuple[int, ...], dist.ProcessGroup]  # sorted leader ranks -> group
    owners: dict[tuple[int, ...], dist.ProcessGroup]  # sorted optimizer-owner ranks -> group (ZeRO-1)
    gradient_holders: dict[str, tuple[int, ...]]  # sync unit -> the leaders all-reducing its gradient
    unit_owners: dict[str, tuple[int, ...]]  # sync unit -> every rank holding it (all replicas, all TP ranks)


def new_groups(layout: Layout, units: list[str], zero_stage: int, timeout_s: float) -> Groups:
    """Every group of a plan, created by every rank of the world in the same order, each with the job's collective
    timeout (`new_group` would give gloo's 30 minutes: a send whose peer died can wait that long, and shut
    connections do not wake it; `survival.py`)."""
    world = dist.get_world_size()
    used = sorted(layout.stage_of_rank)
    timeout = timedelta(seconds=timeout_s)

    def new_group(ranks: list[int]) -> dist.ProcessGroup:
        return dist.new_group(ranks, timeout=timeout)

    plan_group = None if len(used) == world else new_group(used)
    stage_groups, tp, cp = {}, {}, {}
    for i, replica in enumerate(layout.replicas):
        for stage in replica.stages:
            key = (i, stage.stage)
            if len(stage.ranks) > 1:
                stage_groups[key] = new_group(sorted(stage.ranks))
            for c in range(stage.cp):
                if stage.tp > 1:
                    tp[(*key, c)] = stage_groups[key] if stage.cp == 1 else new_group(stage.tp_ranks(c))
            for t in range(stage.tp):
                if stage.cp > 1:
                    cp[(*key, t)] = new_group(stage.cp_ranks(t))
    ep = {}
    for first in range(0, len(layout.replicas), layout.ep) if layout.ep > 1 else ():
        peers = layout.expert_peers(first)
        for s in range(len(layout.replicas[first].stages)):
            group = new_group(sorted(layout.replicas[r].stages[s].leader for r in peers))
            ep.update({(r, s): group for r in peers})
    pp = {i: new_group(sorted(replica.leaders)) for i, replica in enumerate(layout.replicas)}
    leaders, holders = {}, {}
    for unit in units:
        stages = []
        for replica in layout.replicas:
            part = next((part for part in replica.parts if part_holds(part, unit)), None)
            if part is not None:  # a routed expert lives on one replica of each EP group
                stages.append(replica.stages[part.stage])
        leaders[unit] = tuple(sorted(stage.leader for stage in stages))
        holders[unit] = tuple(sorted(rank for stage in stages for rank in stage.ranks))
    sync = {ranks: new_group(list(ranks)) for ranks in sorted(set(leaders.values())) if len(ranks) > 1}
    owner_sets = set(holders.values()) if zero_stage >= 1 else set()
    owners = {ranks: new_group(list(ranks)) for ranks in sorted(owner_sets) if len(ranks) > 1}
    return Groups(plan_group, stage_groups, tp, cp, ep, pp, sync, owners, leaders, holders)


def _csv_rows(plan: Plan, replica_id: int) -> list[list[str]]:
    return list(csv.reader(io.StringIO(torch_csv.render(plan, replica_id))))


@dataclass
class Runtime:
    """What one rank runs for one plan; `stage` is None on a rank the plan does not use."""

    plan: Plan
    layout: Layout
    groups: Groups
    units: list[str]
    rank: int  # this process's rank in the world the runtime was built in (a recovery renumbers the ranks)
    stage: StagePlace | None = None
    replica: ReplicaPlace | None = None
    chunks: dict[int, Chunk] | None = None
    schedule: object | None = None  # the leader's _PipelineScheduleRuntime
    follower: Follower | None = None
    shards: RankShards | None = None

    @property
    def device(self) -> str | None:
        rank = self.rank
        return self.layout.devices[rank] if rank < len(self.layout.devices) else None  # a spare rank: none

    @property
    def active(self) -> bool:
        return self.stage is not None

    @property
    def is_leader(self) -> bool:
        return self.stage is not None and self.rank == self.stage.leader

    @property
    def stage_group(self) -> dist.ProcessGroup | None:
        """Every rank of this rank's stage (None when it has one): they all run the stage's chunks."""
        return None if self.stage is None else self.groups.stage.get((self.stage.replica, self.stage.stage))

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        """The ranks splitting this rank's tensors with it (None without tensor parallelism)."""
        if self.stage is None:
            return None
        _, cp_rank = self.stage.place_of(self.rank)
        return self.groups.tp.get((self.stage.replica, self.stage.stage, cp_rank))

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """The ranks splitting this rank's sequences with it, holding its TP shard (None without CP)."""
        if self.stage is None:
            return None
        tp_rank, _ = self.stage.place_of(self.rank)
        return self.groups.cp.get((self.stage.replica, self.stage.stage, tp_rank))

    @property
    def params(self) -> dict[str, torch.Tensor]:
        return {name: p for chunk in (self.chunks or {}).values() for name, p in chunk.named_parameters()}

    def held_slice(self, unit_index: int) -> Interval:
        """This rank's slice of a unit's tensors along their TP dimension: a dense model's from the service's
        holdings; a mixture of experts' (whose holdings do not map to tensors, `optimizer_parts`) its TP
        rank's share, every tensor split evenly over the stage's TP ranks."""
        if not self.plan.architecture.num_experts:
            return self.shards.weights[unit_index]
        tp_rank, tp = self._tp_index(self.rank), self.stage.tp
        return Fraction(tp_rank, tp), Fraction(tp_rank + 1, tp)

    def optimizer_parts(self, unit: str, unit_index: int) -> tuple[Interval, ...]:
        """The parts of `unit`'s tensors whose Adam state this rank owns ([lo, hi) of their TP dimension,
        `executor.shards`): a dense model's, the service's holdings. The service lays a mixture of experts'
        layer out as one space of replicated weights then experts (`planner.replan.holdings`), which does not
        map to tensors: here each unit's holders sharing a TP slice split it evenly in rank order with ZeRO-1,
        as Megatron's distributed optimizer shards the replicated weights over the data-parallel ranks and a
        routed expert's over its expert data-parallel ranks (the replicas holding it); without ZeRO each owns
        its slice."""
        if not self.plan.architecture.num_experts:
            return self.shards.optimizer[unit_index]
        held = self.held_slice(unit_index)
        if self.plan.zero_stage == 0:
            return (held,)
        mine = self._tp_index(self.rank)
        sharing = [rank for rank in self.groups.unit_owners[unit] if self._tp_index(rank) == mine]
        k, n = sharing.index(self.rank), len(sharing)
        lo, width = held[0], held[1] - held[0]
        return ((lo + width * Fraction(k, n), lo + width * Fraction(k + 1, n)),)

    def _tp_index(self, rank: int) -> int:
        return self.layout.stage_of_rank[rank].place_of(rank)[0]

    def owners_group(self, unit: str) -> dist.ProcessGroup | None:
        """Who sums the optimizer's updates of `unit`: every holder with ZeRO-1, the TP group without."""
        if self.plan.zero_stage >= 1:
            return self.groups.owners.get(self.groups.unit_owners[unit])
        return self.tp_group


def build_runtime(plan: Plan, cfg: ModelConfig, world_devices: list[str], seed: int, timer: OpTimer,
                  world_epoch: int = 0, timeout_s: float = 300.0) -> Runtime:
    """Groups (every rank), then this rank's chunks with seeded full weights sharded for its TP group, and its
    pipeline runtime (the leader) or CSV replay (a follower). `world_epoch` counts the worlds this process has
    been in (a recovery forms a new one); `timeout_s` is the collective timeout of every group."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    from torch.distributed.tensor.parallel import parallelize_module

    layout = build_layout(plan, cfg.num_layers, world_devices)
    units = sync_units(cfg)
    groups = new_groups(layout, units, plan.zero_stage, timeout_s)
    rank = dist.get_rank()
    runtime = Runtime(plan, layout, groups, units, rank)
    if rank not in layout.stage_of_rank:
        return runtime
    stage = layout.stage_of_rank[rank]
    replica = layout.replicas[stage.replica]
    runtime.stage, runtime.replica = stage, replica
    runtime.shards = plan_shards(plan)[layout.devices[rank]]
    tp_group, stage_group = runtime.tp_group, runtime.stage_group
    _, cp_rank = stage.place_of(rank)
    context = None if stage.cp == 1 else ContextParallel(runtime.cp_group, cp_rank, stage.cp)
    experts = (None if layout.ep == 1 else
               ExpertParallel(groups.ep[(stage.replica, stage.stage)], layout.expert_rank(stage.replica), layout.ep))
    p, v, mbs = len(replica.stages), layout.virtual_stages, layout.micro_batch_size
    n_virtual = p * v

    # DTensor caches sharding decisions per mesh, and meshes over the same ranks compare equal whatever their
    # groups: in a new world (a recovery, or another run in this process), a mesh equal to one of the old
    # world's would run on the old, destroyed group. The world's epoch and the group's own name in the
    # dimension's name keep them apart.
    mesh = (DeviceMesh.from_group(tp_group, "cpu", mesh_dim_names=(f"tp_world{world_epoch}_{tp_group.group_name}",))
            if tp_group is not None else None)
    chunks: dict[int, Chunk] = {}
    for virtual in stage.virtuals:
        part = replica.parts[virtual]
        chunk = Chunk(cfg, part.layers, part.has_embed, part.has_head, seed, context, experts)
        if mesh is not None:
            parallelize_module(chunk, mesh, tp_plan(chunk, cfg.swiglu))
        chunks[virtual] = chunk
    runtime.chunks = chunks

    def input_shape(virtual: int) -> tuple[tuple[int, ...], torch.dtype]:
        if virtual == 0:
            return (mbs, cfg.seq_len), torch.long
        return (mbs, cfg.seq_len, cfg.hidden), torch.float32

    rows = _csv_rows(plan, replica.plan_id)
    if len(rows) != p:
        raise RuntimeError(f"replica {replica.plan_id}: {len(rows)} CSV rows for {p} stages")
    # Each of the stage's ranks does 1 / (tp x cp) of its work.
    share = len(stage.ranks)
    if rank != stage.leader:
        layer_mbs = {virtual: len(replica.parts[virtual].layers) * mbs / share for virtual in stage.virtuals}
        runtime.follower = Follower(chunks, n_virtual, stage_group, stage.leader, input_shape, timer, layer_mbs)
        runtime.follower.load_row(rows[stage.stage])
        return runtime
    # Row k of the CSV must be PP-group rank k; new_group orders ranks by number.
    leaders = sorted(replica.leaders)
    permuted = [None] * p
    for s, row in enumerate(rows):
        permuted[leaders.index(replica.stages[s].leader)] = row
    pp_stages = []
    for virtual in stage.virtuals:
        module = chunks[virtual] if stage_group is None else LeaderChunk(chunks[virtual], stage_group, rank)
        shape, dtype = input_shape(virtual)
        example_in = torch.zeros(shape, dtype=dtype)
        if virtual != 0:
            example_in.requires_grad_(True)
        out_shape = (mbs, cfg.seq_len, cfg.vocab if virtual == n_virtual - 1 else cfg.hidden)
        pp_stage = PipelineStage(module, virtual, n_virtual, torch.device("cpu"), input_args=(example_in,),
                                 output_args=(torch.zeros(out_shape, requires_grad=True),),
                                 group=groups.pp[stage.replica])
        layer_mbs = len(replica.parts[virtual].layers) * mbs / share
        works = {
            "forward_one_chunk": lambda kwargs, w=layer_mbs: w * OP_WORK["F"],
            "backward_one_chunk": lambda kwargs, w=layer_mbs: w * OP_WORK["B" if kwargs.get("full_backward", True)
                                                                          else "I"],
            "backward_weight_one_chunk": lambda kwargs, w=layer_mbs: w * OP_WORK["W"],
        }
        for method, work in works.items():
            setattr(pp_stage, method, timer.wrap(getattr(pp_stage, method), work))
        pp_stages.append(pp_stage)
    schedule = _PipelineScheduleRuntime(pp_stages, n_microbatches=replica.num_microbatches, loss_fn=loss_fn,
                                        scale_grads=False)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"replica{replica.plan_id}.csv"
        path.write_text("".join(",".join(row) + "\n" for row in permuted))
        schedule._load_csv(str(path))
    runtime.schedule = schedule
    return runtime
