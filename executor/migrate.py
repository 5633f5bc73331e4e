"""Move a running job's state to a new plan by executing the plan's `migration.transfers`.

Every rank of the world takes part (whatever the plans use it for):
  1. the new plan's ranks fill their new tensors with NaN;
  2. each keeps what it held itself (the overlap of its old and new weight slices, and of its old
     and new optimizer intervals, unit by unit), as the transfers assume;
  3. every transfer runs as one point-to-point message (gloo isend/irecv on the world group, tagged
     by the transfer's index): the sender packs, unit by unit and tensor by tensor in name order,
     the part of each state it lists (`weights`: the parameters; `optimizer`: Adam's two moments),
     the receiver unpacks them into its new slices;
  4. replicated norm weights, delivered as parts like every tensor, are re-assembled over the new
     TP group (a sum of the disjoint slices each TP rank received; not a transfer);
  5. any NaN left in a weight or an owned moment is state nothing delivered: every rank stops with
     an error naming it.

The fp32 parameters are the `weights` (4 bytes each) and the moments the `optimizer` state
(8 bytes each); the service prices bf16 weights and fp32 master weights plus moments, so its
`bytes` are the same pieces at other widths. What went over the wire is reported per transfer.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist

from executor.optimizer import AdamState, Moments
from executor.runtime import Runtime
from executor.shards import Interval, local_slice, overlaps, tp_dim, unit_of_name, units_of_transfer
from wire.migration import MigrationTransfer
from wire.schemas import Plan


@dataclass(frozen=True)
class MigrationReport:
    transfers: list[dict[str, Any]]  # what this rank received: the wire transfer, the bytes that came and when
    bytes_received: int
    regroup_s: float  # filled in by the caller: groups and chunks of the new plan
    transfers_s: float
    reassemble_s: float


def local(t: torch.Tensor) -> torch.Tensor:
    """A parameter's local data, writable in place (a DTensor's shard or the tensor itself)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def full_size(name: str, param: torch.Tensor) -> int:
    return param.shape[tp_dim(name) if param.dim() > 1 else 0]


def _views(name: str, param: torch.Tensor, moments: Moments | None, state: str, held: Interval,
           owned_from: Interval, part: Interval) -> list[torch.Tensor]:
    size = full_size(name, param)
    if state == "weights":
        return [local_slice(local(param), name, size, held, part)]
    if moments is None:
        raise ValueError(f"{name}: the transfer carries optimizer state, but the run keeps none (use --optimizer adam)")
    return [local_slice(m, name, size, owned_from, part) for m in (moments.exp_avg, moments.exp_avg_sq)]


def _names_by_unit(params: dict[str, torch.Tensor], num_layers: int) -> dict[int, list[str]]:
    by_unit: dict[int, list[str]] = {}
    for name in sorted(params):
        by_unit.setdefault(unit_of_name(name, num_layers), []).append(name)
    return by_unit


def _pieces(runtime: Runtime, moments: dict[str, Moments] | None, transfer: MigrationTransfer,
            num_layers: int) -> list[torch.Tensor]:
    """The views of `runtime`'s state a transfer covers, in wire order."""
    params = runtime.params
    by_unit = _names_by_unit(params, num_layers)
    of = transfer.part[2]
    part = (Fraction(transfer.part[0], of), Fraction(transfer.part[1], of))
    views: list[torch.Tensor] = []
    for unit in units_of_transfer(transfer.layers, transfer.embedding, transfer.head, num_layers):
        if unit not in by_unit:
            raise ValueError(f"device {runtime.device} holds no unit {unit} that transfer {transfer} names")
        held = runtime.shards.weights[unit]
        for name in by_unit[unit]:
            for state in transfer.state:
                # Moments are shaped like the weight slice, so they share its coordinates.
                views += _views(name, params[name], (moments or {}).get(name), state, held, held, part)
    return views


@dataclass(frozen=True)
class HeldState:
    """State one device holds, wherever it lives (a running plan's rank, a checkpoint file)."""

    params: dict[str, torch.Tensor]  # name -> local slice (norms whole)
    moments: dict[str, Moments] | None
    weights: dict[int, Interval]
    optimizer: dict[int, tuple[Interval, ...]]
    full_sizes: dict[str, int]  # name -> the whole tensor's TP dimension


def held_state(runtime: Runtime, moments: dict[str, Moments] | None) -> HeldState:
    params = runtime.params
    return HeldState({name: local(p) for name, p in params.items()}, moments, runtime.shards.weights,
                     runtime.shards.optimizer, {name: full_size(name, p) for name, p in params.items()})


def copy_overlap(source: HeldState, new: Runtime, new_moments: dict[str, Moments] | None, num_layers: int) -> None:
    """Into `new`'s slices, whatever of them `source` holds: weights on the overlap of the two weight slices,
    moments on the overlap of the two optimizer intervals."""
    for name, param in new.params.items():
        if name not in source.params:
            continue
        unit = unit_of_name(name, num_layers)
        old_held, new_held = source.weights[unit], new.shards.weights[unit]
        size = full_size(name, param)
        with torch.no_grad():
            for part in overlaps([old_held], [new_held]):
                local_slice(local(param), name, size, new_held, part).copy_(
                    local_slice(source.params[name], name, size, old_held, part))
            if new_moments is None or source.moments is None:
                continue
            for part in overlaps(source.optimizer[unit], new.shards.optimizer[unit]):
                for attr in ("exp_avg", "exp_avg_sq"):
                    local_slice(getattr(new_moments[name], attr), name, size, new_held, part).copy_(
                        local_slice(getattr(source.moments[name], attr), name, size, old_held, part))


def blank(new: Runtime, adam: AdamState | None) -> dict[str, Moments] | None:
    """NaN in every weight and moment of the new plan on this rank: what is not delivered stays visible."""
    if not new.active:
        return None
    with torch.no_grad():
        for param in new.params.values():
            local(param).fill_(math.nan)
    return {name: Moments.unset(local(p)) for name, p in new.params.items()} if adam is not None else None


def complete(new: Runtime, new_moments: dict[str, Moments] | None, adam: AdamState | None, num_layers: int,
             source: str) -> None:
    """Re-assemble replicated norms, then stop every rank together if any state is missing anywhere."""
    problems: list[str] = []
    if new.active:
        _reassemble_norms(new, num_layers)
        problems = _unfilled(new, new_moments, num_layers)
    # Every rank learns of any rank's gap, so all stop together instead of waiting on a rank that stopped.
    everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, problems)
    gaps = [problem for rank_problems in everyone for problem in rank_problems]
    if gaps:
        raise RuntimeError(f"{source} to plan {new.plan.plan_id} left {len(gaps)} gaps: " + "; ".join(gaps[:5]))
    if adam is not None:
        adam.moments = new_moments or {}


def _reassemble_norms(new: Runtime, num_layers: int) -> None:
    """Replicated tensors of a TP stage: each rank has its own slice; sum the disjoint slices."""
    group = new.tp_group
    if group is None:
        return
    from torch.distributed.tensor import DTensor

    for name, param in sorted(new.params.items()):
        if isinstance(param, DTensor):
            continue
        held = new.shards.weights[unit_of_name(name, num_layers)]
        mine = local_slice(param.detach(), name, param.shape[0], held, held).clone()
        with torch.no_grad():
            param.zero_()
            local_slice(param, name, param.shape[0], held, held).copy_(mine)
            dist.all_reduce(param.data, group=group)


def _unfilled(new: Runtime, moments: dict[str, Moments] | None, num_layers: int) -> list[str]:
    """State of the new plan on this rank that nothing delivered (NaN left)."""
    problems = []
    for name, param in new.params.items():
        unit = unit_of_name(name, num_layers)
        if torch.isnan(local(param)).any():
            problems.append(f"device {new.device}: {name} has weights no transfer delivered")
        if moments is None:
            continue
        held, size = new.shards.weights[unit], full_size(name, param)
        for part in new.shards.optimizer[unit]:
            if any(torch.isnan(local_slice(m, name, size, held, part)).any()
                   for m in (moments[name].exp_avg, moments[name].exp_avg_sq)):
                problems.append(f"device {new.device}: {name} has optimizer state [{part[0]}, {part[1]}) no "
                                "transfer delivered")
    return problems


def migrate(old: Runtime, new: Runtime, transfers: list[MigrationTransfer], adam: AdamState | None,
            num_layers: int) -> MigrationReport:
    """Execute `transfers` from `old`'s state to `new`'s on this rank (every rank of the world calls it)."""
    me = new.device
    rank_of = {device: rank for rank, device in enumerate(new.layout.devices)}
    old_moments = adam.moments if adam is not None else None
    started = time.perf_counter()
    new_moments = blank(new, adam)
    if new.active and old.active:
        copy_overlap(held_state(old, old_moments), new, new_moments, num_layers)

    sends, received = [], []
    posted = time.perf_counter()
    for index, transfer in enumerate(transfers):
        if transfer.sender == me:
            if not old.active:
                raise RuntimeError(f"transfer {index} is from {me}, which the running plan does not use")
            views = _pieces(old, old_moments, transfer, num_layers)
            buffer = torch.cat([v.reshape(-1) for v in views])
            sends.append(dist.isend(buffer, dst=rank_of[transfer.to], tag=index))
        if transfer.to == me:
            views = _pieces(new, new_moments, transfer, num_layers)
            buffer = torch.empty(sum(v.numel() for v in views))
            request = dist.irecv(buffer, src=rank_of[transfer.sender], tag=index)
            received.append((index, transfer, views, buffer, request))
    arrived_s = {}
    for index, _, _, _, request in received:  # in order: a time is when this receiver had it, an upper bound
        request.wait()
        arrived_s[index] = time.perf_counter() - posted
    for request in sends:
        request.wait()
    bytes_received, report = 0, []
    with torch.no_grad():
        for index, transfer, views, buffer, _ in received:
            offset = 0
            for view in views:
                view.copy_(buffer[offset : offset + view.numel()].view_as(view))
                offset += view.numel()
            size = buffer.numel() * buffer.element_size()
            bytes_received += size
            report.append({"index": index, **transfer.model_dump(mode="json", by_alias=True), "plan_bytes":
                           transfer.bytes, "bytes": size, "seconds": round(arrived_s[index], 6)})
    transferred = time.perf_counter()
    complete(new, new_moments, adam, num_layers, "the migration")
    return MigrationReport(report, bytes_received, 0.0, transferred - started, time.perf_counter() - transferred)


def switch_events(step: int, old: Plan, new: Plan, report: MigrationReport, regroup_s: float
                  ) -> list[dict[str, Any]]:
    """Events of a switch to `new` at `step`: on rank 0 the switch, on every receiver its transfers."""
    events = [{"event": "transfer", "step": step, **t} for t in report.transfers]
    if dist.get_rank() == 0:
        events.insert(0, {"event": "reconfigure", "step": step, "from_plan": old.plan_id, "to_plan": new.plan_id,
                          "regroup_s": round(regroup_s, 6), "transfers_s": round(report.transfers_s, 6),
                          "reassemble_s": round(report.reassemble_s, 6), "transfers": len(new.migration.transfers),
                          "plan_bytes_moved": new.migration.bytes_moved})
    return events
