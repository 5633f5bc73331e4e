"""Plans around given schedules, and a gloo worker that trains a tiny pipeline from an exported CSV."""

from __future__ import annotations

import copy
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    _PipelineScheduleRuntime,
    _simulate_comms_compute,
)
from torch.distributed.pipelining.stage import _PipelineStageBase

from planner.schedules.ops import ChunkTimes, PipelineSpec, Schedule
from planner.schedules.result import ReplicaTimeline, ScheduleChoice
from planner.schedules.simulator import simulate
from wire.convert import schedule_to_wire
from wire.schemas import Plan

# ---------------------------------------------------------------------------------------------------------------
# Plans


def uniform_spec(p: int, m: int, v: int = 1) -> PipelineSpec:
    times = ChunkTimes(forward_ms=1.0, input_grad_ms=1.0, weight_grad_ms=0.5, activation_gib=0.1)
    return PipelineSpec(chunks=tuple(tuple(times for _ in range(v)) for _ in range(p)), num_microbatches=m)


def schedule_plan(*replicas: tuple[tuple[int, ...], Schedule, PipelineSpec]) -> Plan:
    """A wire Plan whose pipeline_schedule holds the given (replica_ids, schedule, spec) timelines.

    Only the schedule and the replicas' stage and microbatch counts are meaningful; the
    rest is filler that satisfies the schema.
    """
    timelines = tuple(ReplicaTimeline(ids, schedule, simulate(schedule, spec)) for ids, schedule, spec in replicas)
    choice = ScheduleChoice(
        name=max(timelines, key=lambda t: t.simulation.makespan_ms).schedule.name,
        candidates_ms=tuple((t.schedule.name, t.simulation.makespan_ms) for t in timelines),
        replicas=timelines,
    )
    wire_replicas = [
        {
            "id": replica_id,
            "num_microbatches": spec.num_microbatches,
            "stages": [
                {"id": s, "layers": (s, s + 1), "devices": [f"n{replica_id}g{s}"], "tp": 1, "memory_gib": 1.0,
                 "forward_ms": 1.0, "backward_ms": 1.5}
                for s in range(spec.num_stages)
            ],
        }
        for ids, _, spec in replicas
        for replica_id in ids
    ]
    first_spec = replicas[0][2]
    return Plan.model_validate({
        "plan_id": "test-plan",
        "status": "OPTIMAL",
        "uniform": len({spec.num_stages for _, _, spec in replicas}) == 1,
        "micro_batch_size": 1,
        "schedule": choice.name,
        "virtual_stages": first_spec.virtual_stages,
        "recompute": "none",
        "zero_stage": 0,
        "replicas": wire_replicas,
        "unused_devices": [],
        "excluded_devices": [],
        "predicted": {
            "iteration_time_s": 1.0, "tokens_per_s": 1.0, "mfu": 0.5,
            "breakdown": {"compute_s": 1.0, "pipeline_bubble_s": 0.0, "tp_comm_s": 0.0, "dp_comm_s": 0.0},
        },
        "solver": {"status": "OPTIMAL", "wall_time_s": 0.0, "gap": 0.0},
        "pipeline_schedule": schedule_to_wire(choice).model_dump(),
    })


# ---------------------------------------------------------------------------------------------------------------
# A real run: every rank builds its PipelineStage(s) of a tiny MLP, loads the exported CSV into
# PyTorch's _PipelineScheduleRuntime, trains two steps, and compares with a single-process reference.

HIDDEN = 16
ROWS_PER_MICROBATCH = 2


def _tiny_model(num_virtual_stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(num_virtual_stages)))


Case = tuple[str, str, int, int]  # name, csv path, virtual stages, microbatches


def run_worker(rank: int, world_size: int, store_path: str, runs: list[tuple[int, list[Case]]]) -> None:
    """One rank of a gloo world. `runs` are (pipeline size p, cases): ranks 0..p-1 train each case.

    Pipelines smaller than the world use a subgroup, so one world of processes serves
    several pipeline sizes.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size, timeout=timedelta(seconds=30)
    )
    try:
        for p, cases in runs:
            group = dist.group.WORLD if p == world_size else dist.new_group(list(range(p)))
            if rank < p:
                for case in cases:
                    _run_case(rank, p, group, *case)
            dist.barrier()
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def run_child(index: int, world_size: int, store_path: str, runs: list[tuple[int, list[Case]]]) -> None:
    """Entry point of a spawned process: the caller is rank 0, children are ranks 1.."""
    run_worker(index + 1, world_size, store_path, runs)


def _run_case(rank: int, p: int, group: dist.ProcessGroup, name: str, csv_path: str, v: int, m: int) -> None:
    n = p * v
    model = _tiny_model(n)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(m * ROWS_PER_MICROBATCH, HIDDEN, generator=generator)
    target = torch.randn(m * ROWS_PER_MICROBATCH, HIDDEN, generator=generator)
    loss_fn = nn.MSELoss()

    reference = copy.deepcopy(model)
    ref_loss = loss_fn(reference(x), target)
    ref_loss.backward()

    local = [rank + chunk * p for chunk in range(v)]
    stages = [PipelineStage(model[i], i, n, torch.device("cpu"), group=group) for i in local]
    schedule = _PipelineScheduleRuntime(stages, n_microbatches=m, loss_fn=loss_fn)
    schedule._load_csv(csv_path)

    for _ in range(2):  # the second step proves the runtime resets its per-step state
        model.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if 0 in local:
            schedule.step(x)
        elif n - 1 in local:
            schedule.step(target=target, losses=losses)
        else:
            schedule.step()

    if n - 1 in local:
        assert len(losses) == m, f"{name}: {len(losses)} microbatch losses, expected {m}"
        torch.testing.assert_close(torch.stack(losses).mean(), ref_loss.detach(), rtol=1e-5, atol=1e-7)
    for i in local:
        for (param_name, param), ref_param in zip(model[i].named_parameters(), reference[i].parameters()):
            assert param.grad is not None, f"{name}: rank {rank} stage {i} {param_name} got no gradient"
            torch.testing.assert_close(
                param.grad, ref_param.grad, rtol=1e-5, atol=1e-7,
                msg=lambda text, i=i, param_name=param_name: f"{name}: stage {i} {param_name}: {text}",
            )


# ---------------------------------------------------------------------------------------------------------------
# PyTorch's own validation: _PipelineScheduleRuntime._load_csv, then its comms simulator


class _MockStage(_PipelineStageBase):
    """Just what the schedule constructor reads; `_load_csv` needs no model (as in PyTorch's test_schedule.py)."""

    def __init__(self, num_stages: int, group_size: int, group_rank: int = 0):
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.group = None
        self.stage_index_to_group_rank = None

    def _create_grad_recv_info(self, *args, **kwargs):
        return None

    def _prepare_forward_infra(self, *args, **kwargs):
        return None

    def _prepare_backward_infra(self, *args, **kwargs):
        return None


def torch_load(csv_text: str, tmp_path: Path, p: int, v: int, m: int) -> _PipelineScheduleRuntime:
    """Load through PyTorch's loader (structure check + send/recv lowering), then dry-run its comms simulator."""
    path = tmp_path / "schedule.csv"
    path.write_text(csv_text)
    stages = [_MockStage(num_stages=p * v, group_size=p) for _ in range(v)]
    schedule = _PipelineScheduleRuntime(stages, n_microbatches=m)
    schedule._load_csv(str(path))
    # _load_csv's lowering also adds FSDP UNSHARD/RESHARD and REDUCE_GRAD, which the simulator does not know.
    comms = {
        rank: [a for a in actions if a.computation_type.value not in ("UNSHARD", "RESHARD", "REDUCE_GRAD")]
        for rank, actions in schedule.pipeline_order_with_comms.items()
    }
    _simulate_comms_compute(comms, lambda s: schedule.stage_index_to_group_rank[s], p * v)
    return schedule
