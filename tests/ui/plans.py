"""Hand-made plans with simulated schedules, so the UI tests need no solver run."""

from __future__ import annotations

from typing import Any

from planner.schedules.ops import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    ChunkTimes,
    Op,
    PipelineSpec,
    Schedule,
)
from planner.schedules.result import ReplicaTimeline, ScheduleChoice
from planner.schedules.simulator import simulate
from wire.convert import schedule_to_wire
from wire.schemas import Plan


def one_f_one_b(num_stages: int, num_microbatches: int, split_backward: bool = False) -> Schedule:
    """Textbook 1F1B: p - s - 1 warm-up forwards, then alternate; I then W instead of B when split."""
    orders = []
    for stage in range(num_stages):
        warmup = min(num_stages - stage - 1, num_microbatches)
        order: list[Op] = [Op(FORWARD, mb) for mb in range(warmup)]
        next_forward = warmup
        for mb in range(num_microbatches):
            if next_forward < num_microbatches:
                order.append(Op(FORWARD, next_forward))
                next_forward += 1
            order += [Op(INPUT_GRAD, mb), Op(WEIGHT_GRAD, mb)] if split_backward else [Op(BACKWARD, mb)]
        orders.append(tuple(order))
    return Schedule("zb-h1" if split_backward else "1f1b", tuple(orders))


def chunked_gpipe(num_stages: int, num_microbatches: int, chunks: int) -> Schedule:
    """All forwards chunk by chunk, then all backwards in reverse: exercises `F3.1` labels."""
    orders = []
    for _ in range(num_stages):
        forwards = [Op(FORWARD, mb, c) for c in range(chunks) for mb in range(num_microbatches)]
        backwards = [Op(BACKWARD, mb, c) for c in reversed(range(chunks)) for mb in range(num_microbatches)]
        orders.append(tuple(forwards + backwards))
    return Schedule("gpipe", tuple(orders))


def timeline(replica_ids: tuple[int, ...], schedule: Schedule, stages: list[dict[str, Any]], num_microbatches: int,
             chunks: int = 1) -> ReplicaTimeline:
    spec = PipelineSpec(
        chunks=tuple(
            tuple(ChunkTimes(s["forward_ms"] / chunks, s["backward_ms"] / chunks / 2, s["backward_ms"] / chunks / 2, 0.5)
                  for _ in range(chunks))
            for s in stages
        ),
        num_microbatches=num_microbatches,
        p2p_latency_ms=0.5,
    )
    return ReplicaTimeline(replica_ids, schedule, simulate(schedule, spec))


def stage(index: int, layers: tuple[int, int], devices: list[str], speed: float = 1.0, forward_ms: float = 10.0) -> dict:
    return {
        "id": index, "layers": list(layers), "devices": devices, "tp": len(devices), "memory_gib": 40.0,
        "forward_ms": forward_ms / speed, "backward_ms": 2 * forward_ms / speed, "speed": speed,
    }


def plan_body(replicas: list[dict], unused: list[str], excluded: list[str], choice: ScheduleChoice | None,
              **extra: Any) -> Plan:
    body = {
        "plan_id": "hand-made", "status": "optimal", "uniform": False, "micro_batch_size": 1, "schedule": "1f1b",
        "virtual_stages": 1, "recompute": "selective", "zero_stage": 1, "replicas": replicas,
        "unused_devices": unused, "excluded_devices": excluded,
        "predicted": {"iteration_time_s": 1.234, "tokens_per_s": 56789.0, "mfu": 0.4321,
                      "breakdown": {"compute_s": 1.0, "pipeline_bubble_s": 0.2, "tp_comm_s": 0.02, "dp_comm_s": 0.014}},
        "solver": {"status": "OPTIMAL", "wall_time_s": 0.1, "gap": 0.0},
        "model": "llama2-7b <test & \"quotes\">", "gpu_memory_gib": 80.0,
        "pipeline_schedule": schedule_to_wire(choice).model_dump() if choice is not None else None,
    }
    body.update(extra)
    return Plan.model_validate(body)


# 3 nodes x 4 GPUs. Replica 0: 4 stages of TP 2, stage 1 slowed to 0.5 by 0:3. Replica 1: 2 stages of
# TP 1, stage 0 is the slow 2:0 (0.75). 2:2 is slow (0.6) but unused, 2:3 failed.
SLOW_SPEEDS = {"0:3": 0.5, "2:0": 0.75, "2:2": 0.6}
FAILED = ["2:3"]
UNUSED = ["2:2"]


def small_plan(with_schedule: bool = True, microbatches: int = 8) -> Plan:
    replica0 = [
        stage(0, (0, 8), ["0:0", "0:1"]),
        stage(1, (8, 16), ["0:2", "0:3"], speed=0.5),
        stage(2, (16, 24), ["1:0", "1:1"]),
        stage(3, (24, 32), ["1:2", "1:3"]),
    ]
    replica1 = [stage(0, (0, 16), ["2:0"], speed=0.75, forward_ms=20.0), stage(1, (16, 32), ["2:1"], forward_ms=20.0)]
    replicas = [
        {"id": 0, "num_microbatches": microbatches, "stages": replica0},
        {"id": 1, "num_microbatches": microbatches, "stages": replica1},
    ]
    choice = None
    if with_schedule:
        choice = ScheduleChoice(
            name="1f1b",
            candidates_ms=(("1f1b", 0.0),),
            replicas=(
                timeline((0,), one_f_one_b(4, microbatches), replica0, microbatches),
                timeline((1,), one_f_one_b(2, microbatches, split_backward=True), replica1, microbatches),
            ),
        )
    return plan_body(replicas, UNUSED, FAILED, choice)


def interleaved_plan(microbatches: int = 4, chunks: int = 2) -> Plan:
    stages = [stage(0, (0, 16), ["0:0"]), stage(1, (16, 32), ["0:1"])]
    order = chunked_gpipe(2, microbatches, chunks)
    choice = ScheduleChoice("gpipe", (), (timeline((0,), order, stages, microbatches, chunks),))
    return plan_body([{"id": 0, "num_microbatches": microbatches, "stages": stages}], [], [], choice,
                     virtual_stages=chunks)


def large_plan(num_stages: int = 64, microbatches: int = 512, gpus_per_node: int = 8) -> Plan:
    """One replica of `num_stages` TP-8 stages on as many nodes; stage 5 slow."""
    stages = [
        stage(s, (s, s + 1), [f"{s}:{g}" for g in range(gpus_per_node)], speed=0.5 if s == 5 else 1.0)
        for s in range(num_stages)
    ]
    choice = ScheduleChoice("1f1b", (), (timeline((0,), one_f_one_b(num_stages, microbatches), stages, microbatches),))
    return plan_body([{"id": 0, "num_microbatches": microbatches, "stages": stages}], [], [], choice)


def huge_cluster_plan(num_nodes: int = 2048, gpus_per_node: int = 8) -> Plan:
    """No schedule; 8-stage TP-8 replicas on all nodes but the last two, one failed node, one unused node."""
    replicas, node = [], 0
    while node + 8 <= num_nodes - 2:
        stages = [stage(s, (4 * s, 4 * s + 4), [f"{node + s}:{g}" for g in range(gpus_per_node)]) for s in range(8)]
        replicas.append({"id": len(replicas), "num_microbatches": 16, "stages": stages})
        node += 8
    leftover = [f"{n}:{g}" for n in range(node, num_nodes - 1) for g in range(gpus_per_node)]
    failed = [f"{num_nodes - 1}:{g}" for g in range(gpus_per_node)]
    return plan_body(replicas, leftover, failed, None)


def featured_plan() -> Plan:
    """Two 2-stage replicas: replica 0 healthy but with three times the microbatches (the slowest timeline),
    replica 1 holding the slow GPU 1:0 (0.9) in its first stage."""
    healthy = [stage(0, (0, 16), ["0:0"]), stage(1, (16, 32), ["0:1"])]
    damaged = [stage(0, (0, 16), ["1:0"], speed=0.9), stage(1, (16, 32), ["1:1"])]
    replicas = [
        {"id": 0, "num_microbatches": 12, "stages": healthy},
        {"id": 1, "num_microbatches": 4, "stages": damaged},
    ]
    choice = ScheduleChoice("1f1b", (), (
        timeline((0,), one_f_one_b(2, 12), healthy, 12),
        timeline((1,), one_f_one_b(2, 4), damaged, 4),
    ))
    return plan_body(replicas, [], [], choice, slow_devices=[{"device": "1:0", "speed": 0.9}])


def uneven_microbatches_plan(counts: tuple[int, ...] = (21, 22, 21)) -> Plan:
    """One single-stage replica per count, each on its own GPU of node 0: microbatch counts differ."""
    replicas, timelines = [], []
    for index, count in enumerate(counts):
        stages = [stage(0, (0, 32), [f"0:{index}"])]
        replicas.append({"id": index, "num_microbatches": count, "stages": stages})
        timelines.append(timeline((index,), one_f_one_b(1, count), stages, count))
    return plan_body(replicas, [], [], ScheduleChoice("1f1b", (), tuple(timelines)))
