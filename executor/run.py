"""The distributed run of one rank: process groups, pipeline runtime, gradient sync, SGD, telemetry."""

from __future__ import annotations

import csv
import io
import json
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from adapters import torch_csv
from executor.layout import Layout, build_layout, part_holds, sync_units, unit_of
from executor.model import (
    GRAD_WEIGHTINGS,
    Chunk,
    global_batch,
    loss_fn,
    model_config,
    tp_plan,
)
from executor.tensor_parallel import Follower, LeaderChunk
from executor.timing import OpTimer
from wire.schemas import Plan


@dataclass
class Options:
    steps: int = 3
    seed: int = 0
    lr: float = 0.1
    slow_rank: int | None = None
    slow_factor: float = 1.0
    grad_weighting: str = "batch-share"
    layers: int | None = None
    hidden: int | None = None
    ffn: int | None = None
    vocab: int | None = None
    seq: int | None = None


@dataclass
class RankResult:
    rank: int
    device: str | None
    losses: list[float]  # global per-step loss (every rank of the plan has it)
    params: dict[str, torch.Tensor]  # full final tensors of the chunks this rank leads
    replica: int | None  # plan replica id
    telemetry: list[dict[str, Any]]  # this rank's /v1/detect items, one per step


@dataclass
class _Groups:
    plan: dist.ProcessGroup | None
    tp: dict[tuple[int, int], dist.ProcessGroup]  # (replica index, stage) -> group, tp > 1 only
    pp: dict[int, dist.ProcessGroup]  # replica index -> leaders' group
    sync: dict[tuple[int, ...], dist.ProcessGroup]  # sorted leader ranks -> group


def _new_groups(layout: Layout, units: list[str]) -> tuple[_Groups, dict[str, tuple[int, ...]]]:
    """Every group, created by every rank of the world in the same order."""
    world = dist.get_world_size()
    plan_group = None if world == layout.world else dist.new_group(list(range(layout.world)))
    tp = {}
    for i, replica in enumerate(layout.replicas):
        for stage in replica.stages:
            if stage.tp > 1:
                tp[(i, stage.stage)] = dist.new_group(sorted(stage.ranks))
    pp = {i: dist.new_group(sorted(replica.leaders)) for i, replica in enumerate(layout.replicas)}
    holders = {}
    for unit in units:
        ranks = []
        for replica in layout.replicas:
            part = next(part for part in replica.parts if part_holds(part, unit))
            ranks.append(replica.stages[part.stage].leader)
        holders[unit] = tuple(sorted(ranks))
    sync = {ranks: dist.new_group(list(ranks)) for ranks in sorted(set(holders.values())) if len(ranks) > 1}
    return _Groups(plan_group, tp, pp, sync), holders


def _csv_rows(plan: Plan, replica_id: int) -> list[list[str]]:
    return list(csv.reader(io.StringIO(torch_csv.render(plan, replica_id))))


def run(plan: Plan, options: Options) -> RankResult:
    """This rank's part of training `plan` for `options.steps` steps. The process group must be initialised."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    if options.grad_weighting not in GRAD_WEIGHTINGS:
        raise ValueError(f"grad_weighting must be one of {GRAD_WEIGHTINGS}")
    cfg = model_config(plan, layers=options.layers, hidden=options.hidden, ffn=options.ffn, vocab=options.vocab,
                       seq=options.seq)
    layout = build_layout(plan, cfg.num_layers)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < layout.world:
        raise RuntimeError(f"the plan uses {layout.world} devices; launch {layout.world} ranks, not {world}")
    units = sync_units(cfg)
    groups, holders = _new_groups(layout, units)
    if rank >= layout.world:
        return RankResult(rank, None, [], {}, None, [])

    stage = layout.stage_of_rank[rank]
    replica = layout.replicas[stage.replica]
    is_leader = rank == stage.leader
    tp_group = groups.tp.get((stage.replica, stage.stage))
    p, v, mbs = len(replica.stages), layout.virtual_stages, layout.micro_batch_size
    n_virtual = p * v
    timer = OpTimer(options.slow_factor if rank == options.slow_rank else 1.0)

    # Chunks: full deterministic weights, then this rank's TP shard.
    mesh = DeviceMesh.from_group(tp_group, "cpu") if tp_group is not None else None
    chunks: dict[int, Chunk] = {}
    for virtual in stage.virtuals:
        part = replica.parts[virtual]
        chunk = Chunk(cfg, part.layers, part.has_embed, part.has_head, options.seed)
        if mesh is not None:
            parallelize_module(chunk, mesh, tp_plan(chunk, cfg.swiglu))
        chunks[virtual] = chunk
    params = {name: param for chunk in chunks.values() for name, param in chunk.named_parameters()}

    def input_shape(virtual: int) -> tuple[tuple[int, ...], torch.dtype]:
        if virtual == 0:
            return (mbs, cfg.seq_len), torch.long
        return (mbs, cfg.seq_len, cfg.hidden), torch.float32

    rows = _csv_rows(plan, replica.plan_id)
    if len(rows) != p:
        raise RuntimeError(f"replica {replica.plan_id}: {len(rows)} CSV rows for {p} stages")
    schedule = follower = None
    if is_leader:
        pp_group = groups.pp[stage.replica]
        # Row k of the CSV must be PP-group rank k; new_group orders ranks by number.
        leaders = sorted(replica.leaders)
        permuted = [None] * p
        for s, row in enumerate(rows):
            permuted[leaders.index(replica.stages[s].leader)] = row
        pp_stages = []
        for virtual in stage.virtuals:
            module = chunks[virtual] if tp_group is None else LeaderChunk(chunks[virtual], tp_group, rank)
            shape, dtype = input_shape(virtual)
            example_in = torch.zeros(shape, dtype=dtype)
            if virtual != 0:
                example_in.requires_grad_(True)
            out_shape = (mbs, cfg.seq_len, cfg.vocab if virtual == n_virtual - 1 else cfg.hidden)
            pp_stage = PipelineStage(module, virtual, n_virtual, torch.device("cpu"), input_args=(example_in,),
                                     output_args=(torch.zeros(out_shape, requires_grad=True),), group=pp_group)
            for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(pp_stage, method, timer.wrap(getattr(pp_stage, method)))
            pp_stages.append(pp_stage)
        schedule = _PipelineScheduleRuntime(pp_stages, n_microbatches=replica.num_microbatches, loss_fn=loss_fn,
                                            scale_grads=False)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"replica{replica.plan_id}.csv"
            path.write_text("".join(",".join(row) + "\n" for row in permuted))
            schedule._load_csv(str(path))
    else:
        follower = Follower(chunks, n_virtual, tp_group, stage.leader, input_shape, timer)
        follower.load_row(rows[stage.stage])

    # Replica contribution to the full-batch mean gradient (see the module docstring).
    if options.grad_weighting == "batch-share":
        coefficient = mbs / layout.global_batch_size
    else:
        coefficient = 1.0 / (len(layout.replicas) * replica.num_microbatches)
    first_rows = slice(replica.first_sequence, replica.first_sequence + replica.num_microbatches * mbs)
    first_stage, last_stage = 0 in stage.virtuals, n_virtual - 1 in stage.virtuals
    device = layout.devices[rank]
    losses: list[float] = []
    telemetry: list[dict[str, Any]] = []

    def to_full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    for step in range(options.steps):
        for param in params.values():
            param.grad = None
        inputs, targets = global_batch(cfg, layout.global_batch_size, step, options.seed)
        mb_losses: list[torch.Tensor] = []
        if schedule is not None:
            args = (inputs[first_rows],) if first_stage else ()
            kwargs = {"target": targets[first_rows], "losses": mb_losses} if last_stage else {}
            schedule.step(*args, **kwargs)
        else:
            follower.step()

        # Gradients: full tensors, weighted all-reduce among the replicas' leaders, re-shard.
        with torch.no_grad():
            for unit in units:
                names = [name for name in params if unit_of(name) == unit]
                if not names:
                    continue
                full = _full_tensors([params[name].grad for name in names], tp_group)
                flat = torch.cat([g.reshape(-1) for g in full]) if is_leader else torch.empty(
                    sum(g.numel() for g in full))
                if is_leader:
                    flat.mul_(coefficient)
                    if holders[unit] in groups.sync:
                        dist.all_reduce(flat, group=groups.sync[holders[unit]])
                if tp_group is not None:
                    dist.broadcast(flat, src=stage.leader, group=tp_group)
                offset = 0
                for name, g in zip(names, full, strict=True):
                    reduced = flat[offset : offset + g.numel()].view_as(g)
                    offset += g.numel()
                    param = params[name]
                    if isinstance(param, DTensor):
                        param.grad = distribute_tensor(reduced, param.device_mesh, param.placements,
                                                       src_data_rank=None)
                    else:
                        param.grad = reduced.clone()
            for param in params.values():
                param.sub_(param.grad, alpha=options.lr)

        # The step's loss: mean over every microbatch of every replica.
        total = torch.tensor([float(sum(loss.item() for loss in mb_losses)), float(len(mb_losses))],
                             dtype=torch.float64)
        dist.all_reduce(total, group=groups.plan)
        losses.append((total[0] / total[1]).item())
        ms = timer.take()
        telemetry.append({
            "device": device,
            "iteration": step,
            "microbatches": [{"seq_lengths": [cfg.seq_len] * mbs, "compute_ms": round(ms.get(mb, 0.0), 4)}
                             for mb in range(replica.num_microbatches)],
            "last_heartbeat_s_ago": 0.0,
        })

    final = {name: to_full(param.detach()).clone() for name, param in params.items()}
    return RankResult(rank, device, losses, final if is_leader else {}, replica.plan_id, telemetry)


def _full_tensors(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """The full tensors of one sync unit's (possibly sharded) tensors.

    Evenly sharded DTensors travel in one all-gather over the TP group; any other DTensor
    uses `full_tensor()`. Replicated tensors are already full.
    """
    from torch.distributed.tensor import DTensor, Shard

    full = list(tensors)
    sharded = [i for i, t in enumerate(tensors) if isinstance(t, DTensor)]
    if not sharded:
        return full

    def even(t: DTensor) -> bool:
        placement = t.placements[0]
        return len(t.placements) == 1 and isinstance(placement, Shard) and t.shape[placement.dim] % t.device_mesh.size() == 0

    if group is None or not all(even(tensors[i]) for i in sharded):
        for i in sharded:
            full[i] = tensors[i].full_tensor()
        return full
    local = torch.cat([tensors[i].to_local().reshape(-1) for i in sharded])
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local, group=group)
    offset = 0
    for i in sharded:
        shape = tensors[i].to_local().shape
        n = shape.numel()
        full[i] = torch.cat([piece[offset : offset + n].view(shape) for piece in pieces], dim=tensors[i].placements[0].dim)
        offset += n
    return full


def gather_telemetry(result: RankResult, world_devices: int) -> list[dict[str, Any]] | None:
    """All ranks' telemetry items on rank 0 (None elsewhere), ordered by iteration then rank."""
    items: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(result.telemetry, items, dst=0)
    if items is None:
        return None
    per_rank = [rank_items for rank_items in items[:world_devices] if rank_items]
    steps = max((len(rank_items) for rank_items in per_rank), default=0)
    return [rank_items[step] for step in range(steps) for rank_items in per_rank if step < len(rank_items)]


def run_rank(rank: int, world: int, init_method: str, plan_json: str, options: Options,
             out_dir: str | None = None, telemetry_path: str | None = None, timeout_s: float = 60.0) -> RankResult:
    """Join a gloo world, run the plan, optionally save this rank's results, leave the world."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        return run_and_save(Plan.model_validate_json(plan_json), options, out_dir, telemetry_path)
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def run_and_save(plan: Plan, options: Options, out_dir: str | None, telemetry_path: str | None) -> RankResult:
    result = run(plan, options)
    world_devices = len({d for r in plan.replicas for s in r.stages for d in s.devices})
    items = gather_telemetry(result, world_devices)
    if telemetry_path and items is not None:
        with open(telemetry_path, "w") as out:
            out.writelines(json.dumps(item) + "\n" for item in items)
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        torch.save({"rank": result.rank, "device": result.device, "replica": result.replica,
                    "losses": result.losses, "params": result.params},
                   Path(out_dir) / f"rank{result.rank}.pt")
    dist.barrier()
    return result


