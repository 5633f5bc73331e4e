"""The distributed run of one rank: plan segments, training steps, gradient sync, optimizer, telemetry."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from executor import checkpoint
from executor.layout import device_key, plan_devices, unit_of, world_devices
from executor.live import LiveLoop, LiveOptions
from executor.migrate import full_size, local, migrate, switch_events
from executor.model import GRAD_WEIGHTINGS, ModelConfig, global_batch, model_config
from executor.optimizer import OPTIMIZERS, AdamSettings, AdamState, Moments, adam_update
from executor.recovery import Lost, Progress, arm_failure, recover, start_watchdog
from executor.runtime import Runtime, build_runtime
from executor.shards import local_slice, unit_of_name
from executor.timing import OpTimer, Slowdown, slow_factor
from wire.schemas import Plan

WHOLE = (0, 1)


@dataclass
class Options:
    steps: int = 3
    seed: int = 0
    lr: float = 0.1
    optimizer: str = "sgd"
    adam_eps: float = 1e-8
    slowdowns: tuple[Slowdown, ...] = ()
    emulate_ms_per_layer: float | None = None  # behave like GPUs: ops last this per layer-microbatch (timing.py)
    checkpoint_every: int | None = None  # save a sharded checkpoint after every N-th step (checkpoint.py)
    checkpoint_dir: str | None = None
    resume: str | None = None  # a checkpoint directory: start from its newest complete step, on this plan
    fail_device: tuple[str, int] | None = None  # (device, step): that device's process SIGKILLs itself then
    survive_dir: str | None = None  # survive lost ranks (recovery.py): heartbeats and rendezvous go here
    heartbeat_timeout_s: float = 5.0
    timeout_s: float = 300.0  # the collective timeout the world was started with (a survivors' world too)
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
    losses: list[float]  # global per-step loss (complete on rank 0)
    params: dict[str, torch.Tensor]  # full final tensors of the chunks this rank leads in the last plan
    replica: int | None  # plan replica id in the last plan
    telemetry: list[dict[str, Any]]  # this rank's /v1/detect items, one per step it ran
    loss_records: list[dict[str, Any]] = field(default_factory=list)  # {"step", "loss", "plan_id", "step_s"}
    events: list[dict[str, Any]] = field(default_factory=list)  # rank 0: reconfigurations and transfers


def segments_of(plan: Plan, reconfigure: list[tuple[int, Plan]], steps: int, first_step: int = 0
                ) -> list[tuple[int, int, Plan]]:
    """(first step, end step, plan) per plan in the order the run uses them."""
    if not 0 <= first_step < steps:
        raise ValueError(f"the run starts at step {first_step}, but --steps is {steps}")
    starts = [(first_step, plan), *sorted(reconfigure, key=lambda item: item[0])]
    for (a, _), (b, _) in zip(starts, starts[1:]):
        if not a < b < steps:
            raise ValueError(f"--reconfigure steps must increase and lie in {first_step + 1}..{steps - 1}: "
                             f"got {b} after {a}")
    ends = [start for start, _ in starts[1:]] + [steps]
    return [(start, end, p) for (start, p), end in zip(starts, ends, strict=True)]


def _check_compatible(cfg: ModelConfig, plans: list[Plan]) -> None:
    first = plans[0]
    for plan in plans[1:]:
        if plan.architecture != first.architecture or plan.global_batch_size != first.global_batch_size:
            raise ValueError(f"plan {plan.plan_id} trains another model or batch than {first.plan_id}: a live switch "
                             "keeps both")
        if plan.migration is None:
            raise ValueError(f"plan {plan.plan_id} carries no migration: switch only to a replan's answer")
    if len(plans) > 1 and cfg.num_layers != first.replicas[0].stages[-1].layers[1]:
        raise ValueError("--layers cannot change the layer count of a run that switches plans: the transfers "
                         "name the plan's layers")


def run(plan: Plan, options: Options, reconfigure: list[tuple[int, Plan]] = (),
        live: LiveOptions | None = None) -> RankResult:
    """This rank's part of training `plan` (then each `reconfigure` plan from its step on, and with `live` the
    replans the service answers to what `/v1/detect` finds) for `options.steps` steps. The process group must be
    initialised, with one rank per device any of the plans uses."""
    if options.grad_weighting not in GRAD_WEIGHTINGS:
        raise ValueError(f"grad_weighting must be one of {GRAD_WEIGHTINGS}")
    if options.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}")
    resume_dir, first_step = None, 0
    if options.resume:
        resume_dir, meta = checkpoint.latest(options.resume)
        first_step = meta["next_step"]
    segments = segments_of(plan, list(reconfigure), options.steps, first_step)
    plans = [p for _, _, p in segments]
    cfg = model_config(plan, layers=options.layers, hidden=options.hidden, ffn=options.ffn, vocab=options.vocab,
                       seq=options.seq)
    _check_compatible(cfg, plans)
    if cfg.num_experts and (len(plans) > 1 or live is not None
                            or options.checkpoint_every or options.resume or options.survive_dir):
        raise ValueError("the reference executor trains a mixture of experts on one plan only: checkpoints and "
                         "live switches move state by the service's holdings, which lay experts out in a space the "
                         "executor does not map")
    devices = world_devices(plans)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < len(devices):
        raise RuntimeError(f"the plans use {len(devices)} devices; launch {len(devices)} ranks, not {world}")
    device = devices[rank] if rank < len(devices) else None
    adam = AdamState(AdamSettings(options.lr, eps=options.adam_eps)) if options.optimizer == "adam" else None
    loop = LiveLoop(live) if live is not None else None
    watchdog = None
    if options.survive_dir is not None:
        if live is None or world != len(devices):
            raise ValueError("surviving a lost rank needs --server (for the replan) and one rank per device")
        watchdog = start_watchdog(options.survive_dir, options.heartbeat_timeout_s, devices)
    timer = OpTimer(emulate_ms_per_layer=options.emulate_ms_per_layer)
    telemetry: list[dict[str, Any]] = []
    window: list[dict[str, Any]] = []  # this rank's telemetry of the current plan, for the live loop
    records: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    runtime: Runtime | None = None
    progress = Progress(first_step)
    switches = {start: segment_plan for start, _, segment_plan in segments}
    step = first_step
    while step < options.steps:
        step_began = time.perf_counter()
        try:
            if step in switches:
                target = switches.pop(step)
                _check_compatible(cfg, [plan, target] if runtime is not None else [plan])
                began = time.perf_counter()
                new = build_runtime(target, cfg, devices, options.seed, timer, watchdog.epoch if watchdog else 0,
                                    options.timeout_s)
                regrouped = time.perf_counter()
                if runtime is None and resume_dir is not None:
                    loaded_s = checkpoint.load(resume_dir, new, adam, cfg.num_layers)
                    if rank == 0:
                        events.append({"event": "resume", "step": step, "checkpoint": str(resume_dir),
                                       "plan_id": target.plan_id, "seconds": round(loaded_s, 6)})
                elif runtime is None:
                    if adam is not None and new.active:
                        adam.moments = _fresh_moments(new, cfg.num_layers)
                else:
                    report = migrate(runtime, new, target.migration.transfers, adam, cfg.num_layers)
                    events += switch_events(step, runtime.plan, target, report, regrouped - began)
                runtime, window = new, []
            arm_failure(options.fail_device, device, step, runtime, timer)
            if runtime.active:
                timer.slow_factor = slow_factor(options.slowdowns, device, step)
                compute_began = time.perf_counter()
                loss = _train_step(runtime, cfg, step, options, adam, timer, progress)
                records.append({"step": step, "loss": loss, "plan_id": runtime.plan.plan_id,
                                "step_s": round(time.perf_counter() - compute_began, 6)})
                telemetry.append(_telemetry_item(runtime, cfg, step, timer.take()))
                window.append(telemetry[-1])
            if options.checkpoint_every and (step + 1) % options.checkpoint_every == 0:
                saved_s = checkpoint.save(options.checkpoint_dir, runtime, adam, step + 1)
                if rank == 0:
                    events.append({"event": "checkpoint", "step": step, "next_step": step + 1,
                                   "seconds": round(saved_s, 6)})
            if loop is not None and loop.due(step, options.steps):
                found, found_events = loop.check(step, runtime.plan, window)
                events += found_events if rank == 0 else []
                if found is not None:
                    missing = sorted(set(plan_devices(found)) - set(devices), key=device_key)
                    if missing:
                        raise RuntimeError(f"replan {found.plan_id} uses devices no process runs: {missing}")
                    switches[step + 1] = found
        except Exception as error:
            if watchdog is None or runtime is None:
                raise
            lost = Lost(error, watchdog, runtime, progress, step, step_began)
            recovery = recover(lost, options.timeout_s, live.server, live.token, cfg, options.seed, timer, adam,
                               options.checkpoint_dir)
            runtime, devices, step = recovery.runtime, recovery.devices, recovery.next_step
            rank, window = dist.get_rank(), []
            records = [r for r in records if r["step"] < step]  # steps a checkpoint takes back are run again
            telemetry = [t for t in telemetry if t["iteration"] < step]
            events += recovery.events
            timer.take()
            if switches:  # --reconfigure plans name the old world's devices and state
                events += [{"event": "dropped", "step": s, "plan_id": p.plan_id} for s, p in switches.items()
                           if rank == 0]
                switches = {}
            if loop is not None:
                loop.client = None  # its connection was shut with the old world's
            continue
        step += 1
    if watchdog is not None:
        watchdog.finish()
    gathered = _gather_on_rank0((records, events))
    losses: list[float] = []
    if gathered is not None:
        by_step = {r["step"]: r for rank_records, _ in gathered for r in rank_records}
        records = [by_step[step] for step in sorted(by_step)]
        losses = [r["loss"] for r in records]
        events = [event for _, rank_events in gathered for event in rank_events]
        events.sort(key=lambda e: (e["step"], _EVENT_ORDER.index(e["event"]), e.get("index", -1)))
    # Every TP rank takes part in full_tensor(); the leader keeps the result.
    final = {name: _full(param.detach()).clone() for name, param in runtime.params.items()}
    replica = runtime.replica.plan_id if runtime.active else None
    return RankResult(rank, device, losses, final if runtime.is_leader else {}, replica, telemetry,
                      records if gathered else [], events)


_EVENT_ORDER = ("recovery", "dropped", "resume", "checkpoint", "detection", "replan", "reconfigure", "transfer")


def _fresh_moments(runtime: Runtime, num_layers: int) -> dict[str, Moments]:
    """Zero moments where this rank owns optimizer state, NaN elsewhere."""
    moments = {}
    for name, param in runtime.params.items():
        index = unit_of_name(name, num_layers)
        held, size = runtime.held_slice(index), full_size(name, param)
        moments[name] = Moments.unset(local(param))
        for part in runtime.optimizer_parts(unit_of(name), index):
            for m in (moments[name].exp_avg, moments[name].exp_avg_sq):
                local_slice(m, name, size, held, part).zero_()
    return moments


def _gather_on_rank0(value: Any) -> list[Any] | None:
    items: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, items, dst=0)
    return items


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _train_step(rt: Runtime, cfg: ModelConfig, step: int, options: Options, adam: AdamState | None,
                timer: OpTimer, progress: Progress) -> float:
    """One iteration of `rt`'s plan on this rank; the step's global loss."""
    layout, stage, replica = rt.layout, rt.stage, rt.replica
    params = rt.params
    mbs, n_virtual = layout.micro_batch_size, len(replica.stages) * layout.virtual_stages
    for param in params.values():
        param.grad = None
    inputs, targets = global_batch(cfg, layout.global_batch_size, step, options.seed)
    rows = slice(replica.first_sequence, replica.first_sequence + replica.num_microbatches * mbs)
    mb_losses: list[torch.Tensor] = []
    if rt.schedule is not None:
        args = (inputs[rows],) if 0 in stage.virtuals else ()
        kwargs = {"target": targets[rows], "losses": mb_losses} if n_virtual - 1 in stage.virtuals else {}
        rt.schedule.step(*args, **kwargs)
    else:
        rt.follower.step()
    # Replica contribution to the full-batch mean gradient (see the package docstring).
    if options.grad_weighting == "batch-share":
        coefficient = mbs / layout.global_batch_size
    else:
        coefficient = 1.0 / (len(layout.replicas) * replica.num_microbatches)
    if adam is not None:
        adam.steps_done = step + 1  # the job's count: a rank idle for some steps must not lag behind
    progress.torn = True  # until every unit is updated: a failure in between leaves a mixed state
    with torch.no_grad():
        for unit in rt.units:
            names = [name for name in params if unit_of(name) == unit]
            if names:
                reduced = _reduced_gradients(rt, unit, [params[name].grad for name in names], coefficient)
                if adam is None:
                    _sgd(params, names, reduced, options.lr)
                else:
                    _adam(rt, unit, names, reduced, adam, cfg.num_layers)
    progress.next_step, progress.torn = step + 1, False
    # The step's loss: mean over every microbatch of every replica.
    total = torch.tensor([float(sum(loss.item() for loss in mb_losses)), float(len(mb_losses))], dtype=torch.float64)
    dist.all_reduce(total, group=rt.groups.plan)
    return (total[0] / total[1]).item()


def _reduced_gradients(rt: Runtime, unit: str, grads: list[torch.Tensor], coefficient: float) -> list[torch.Tensor]:
    """Full tensors, summed over the context-parallel ranks for a layer's, weighted all-reduce among the
    replicas' leaders, broadcast to the stage."""
    full = _full_tensors(grads, rt.tp_group)
    # A layer's context-parallel ranks each ran their own positions of every sequence: their gradients add up
    # to the whole sequences'. The embedding, norm and head ran on whole sequences on each alike.
    over_positions = rt.cp_group is not None and unit.startswith("layers.")
    if rt.is_leader or over_positions:
        flat = torch.cat([g.reshape(-1) for g in full])
    else:
        flat = torch.empty(sum(g.numel() for g in full))
    if over_positions:
        dist.all_reduce(flat, group=rt.cp_group)
    if rt.is_leader:
        flat.mul_(coefficient)
        leaders = rt.groups.gradient_holders[unit]
        if leaders in rt.groups.sync:
            dist.all_reduce(flat, group=rt.groups.sync[leaders])
    if rt.stage_group is not None:
        dist.broadcast(flat, src=rt.stage.leader, group=rt.stage_group)
    reduced, offset = [], 0
    for g in full:
        reduced.append(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    return reduced


def _sgd(params: dict[str, torch.Tensor], names: list[str], reduced: list[torch.Tensor], lr: float) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, g in zip(names, reduced, strict=True):
        param = params[name]
        if isinstance(param, DTensor):
            g = distribute_tensor(g, param.device_mesh, param.placements, src_data_rank=None)
        param.sub_(g, alpha=lr)


def _adam(rt: Runtime, unit: str, names: list[str], reduced: list[torch.Tensor], adam: AdamState,
          num_layers: int) -> None:
    """Adam on the parts this rank owns; the owners' sum of their updated parts is every holder's new tensor."""
    params = rt.params
    index = unit_of_name(names[0], num_layers)
    held, owned = rt.held_slice(index), rt.optimizer_parts(unit, index)
    group = rt.owners_group(unit)
    updated = [torch.zeros_like(g) for g in reduced] if group is not None else None
    for i, (name, g) in enumerate(zip(names, reduced, strict=True)):
        mine, size, moments = local(params[name]), full_size(name, params[name]), adam.moments[name]
        for part in owned:
            view = local_slice(mine, name, size, held, part)
            adam_update(view, local_slice(g, name, size, WHOLE, part),
                        local_slice(moments.exp_avg, name, size, held, part),
                        local_slice(moments.exp_avg_sq, name, size, held, part), adam.steps_done, adam.settings)
            if updated is not None:
                local_slice(updated[i], name, size, WHOLE, part).copy_(view)
    if updated is None:
        return
    flat = torch.cat([u.reshape(-1) for u in updated])
    dist.all_reduce(flat, group=group)
    offset = 0
    for name, u in zip(names, updated, strict=True):
        whole = flat[offset : offset + u.numel()].view_as(u)
        offset += u.numel()
        mine = local(params[name])
        mine.copy_(whole if mine.shape == whole.shape else
                   local_slice(whole, name, full_size(name, params[name]), WHOLE, held))


def _telemetry_item(rt: Runtime, cfg: ModelConfig, step: int, ms: dict[int, float]) -> dict[str, Any]:
    mbs = rt.layout.micro_batch_size
    return {
        "device": rt.device,
        "iteration": step,
        "microbatches": [{"seq_lengths": [cfg.seq_len] * mbs, "compute_ms": round(ms.get(mb, 0.0), 4)}
                         for mb in range(rt.replica.num_microbatches)],
        "last_heartbeat_s_ago": 0.0,
    }


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
        return (len(t.placements) == 1 and isinstance(placement, Shard)
                and t.shape[placement.dim] % t.device_mesh.size() == 0)

    if group is None or not all(even(tensors[i]) for i in sharded):
        for i in sharded:
            full[i] = tensors[i].full_tensor()
        return full
    local_flat = torch.cat([tensors[i].to_local().reshape(-1) for i in sharded])
    pieces = [torch.empty_like(local_flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local_flat, group=group)
    offset = 0
    for i in sharded:
        shape = tensors[i].to_local().shape
        n = shape.numel()
        full[i] = torch.cat([piece[offset : offset + n].view(shape) for piece in pieces],
                            dim=tensors[i].placements[0].dim)
        offset += n
    return full


def gather_telemetry(result: RankResult) -> list[dict[str, Any]] | None:
    """All ranks' telemetry items on rank 0 (None elsewhere), ordered by iteration then rank."""
    items = _gather_on_rank0(result.telemetry)
    if items is None:
        return None
    ordered = sorted((item["iteration"], rank, n) for rank, rank_items in enumerate(items)
                     for n, item in enumerate(rank_items))
    return [items[rank][n] for _, rank, n in ordered]


def run_rank(rank: int, world: int, init_method: str, plan_json: str, options: Options,
             out_dir: str | None = None, telemetry_path: str | None = None, timeout_s: float = 60.0,
             reconfigure: list[tuple[int, str]] = (), live: LiveOptions | None = None) -> RankResult:
    """Join a gloo world, run the plan(s), optionally save this rank's results, leave the world."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    options = replace(options, timeout_s=timeout_s)  # every group of the run gets the world's timeout
    try:
        switches = [(step, Plan.model_validate_json(text)) for step, text in reconfigure]
        return run_and_save(Plan.model_validate_json(plan_json), options, out_dir, telemetry_path, switches, live)
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def run_and_save(plan: Plan, options: Options, out_dir: str | None, telemetry_path: str | None,
                 reconfigure: list[tuple[int, Plan]] = (), live: LiveOptions | None = None) -> RankResult:
    """Run, then write the telemetry (rank 0), each rank's `rank<R>.pt` and, on rank 0, `losses.jsonl` and
    `events.jsonl` in `out_dir`."""
    result = run(plan, options, reconfigure, live)
    items = gather_telemetry(result)
    if telemetry_path and items is not None:
        _write_jsonl(Path(telemetry_path), items)
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"rank": result.rank, "device": result.device, "replica": result.replica,
                    "losses": result.losses, "params": result.params}, out / f"rank{result.rank}.pt")
        if dist.get_rank() == 0:
            _write_jsonl(out / "losses.jsonl", result.loss_records)
            _write_jsonl(out / "events.jsonl", result.events)
    dist.barrier()
    return result


def _write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    with open(path, "w") as out:
        out.writelines(json.dumps(record) + "\n" for record in records)
