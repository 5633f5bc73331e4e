"""Iteration time of one layout: stage times, pipeline, gradient sync, optimizer.

    iteration = pipeline_time(stage times) + max over stages of the exposed
                data-parallel sync + max over stages of the optimizer step

Exposed sync: the gradient all-reduce (ZeRO-1: reduce-scatter) runs under the
last microbatch's backward, bucket by bucket, so at least the last bucket is
exposed (all of it without the overlap); ZeRO-1's weight all-gather runs
under the next forward, at least its first bucket exposed (all of it after
the optimizer step without the overlap).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cost_models.pipeline import pipeline_time_ms
from cost_models.resharding import exposed_sync_ms
from cost_models.stage_costs import StageCostTerms, stage_memory


@dataclass(frozen=True)
class StageTime:
    """One stage position, per microbatch, at the stage's speed (ms)."""

    forward_ms: float
    backward_ms: float
    compute_ms: float  # forward + backward compute part
    tp_comm_ms: float
    p2p_ms: float
    params: float  # per GPU
    memory_bytes: float
    weight_grad_ms: float = 0.0  # part of backward_ms a zero-bubble schedule may defer
    static_memory_bytes: float = 0.0
    activation_bytes_per_microbatch: float = 0.0
    shard_comm_ms: float = 0.0  # ZeRO-2/3's exposed per-microbatch data-parallel traffic (forward + backward)
    cp_comm_ms: float = 0.0  # context parallelism's exposed key/value exchange (forward + backward)
    ep_comm_ms: float = 0.0  # expert parallelism's all-to-all token exchange (forward + backward)

    @property
    def total_ms(self) -> float:
        return self.forward_ms + self.backward_ms


@dataclass(frozen=True)
class IterationEstimate:
    stages: tuple[StageTime, ...]
    pipeline_ms: float
    dp_exposed_ms: float
    optimizer_ms: float
    bottleneck_stage: int
    num_microbatches: int

    @property
    def iteration_ms(self) -> float:
        return self.pipeline_ms + self.dp_exposed_ms + self.optimizer_ms

    @property
    def breakdown_s(self) -> dict[str, float]:
        """Seconds on the bottleneck stage's critical path; the parts sum to the iteration."""
        slowest = self.stages[self.bottleneck_stage]
        m = self.num_microbatches
        steady_ms = m * slowest.total_ms
        return {
            "compute_s": m * slowest.compute_ms / 1e3,
            "tp_comm_s": m * slowest.tp_comm_ms / 1e3,
            "pp_comm_s": m * slowest.p2p_ms / 1e3,
            "pipeline_bubble_s": (self.pipeline_ms - steady_ms) / 1e3,
            "dp_comm_s": (self.dp_exposed_ms + m * slowest.shard_comm_ms) / 1e3,
            "optimizer_s": self.optimizer_ms / 1e3,
            "cp_comm_s": m * slowest.cp_comm_ms / 1e3,
            "ep_comm_s": m * slowest.ep_comm_ms / 1e3,
        }


def _stage_parts(terms: StageCostTerms, stage: int, layers: int) -> list:
    parts = [(terms.layer, layers)]
    if stage == 0:
        parts.append((terms.embedding, 1))
    if stage == terms.shape.pp - 1:
        parts.append((terms.head, 1))
    return parts


def _forward_ms(parts: list, speed: float, half_p2p: float) -> float:
    compute = sum(part.time.forward_compute_ms * count for part, count in parts) / speed
    return compute + sum(part.time.forward_comm_ms * count for part, count in parts) + half_p2p


def _backward_ms(parts: list, speed: float, half_p2p: float) -> float:
    compute = sum(part.time.backward_compute_ms * count for part, count in parts) / speed
    return compute + sum(part.time.backward_comm_ms * count for part, count in parts) + half_p2p


def chunk_work_ms(terms: StageCostTerms, stage: int, chunk_layers: Sequence[int]) -> tuple[tuple[float, float], ...]:
    """(forward, backward) ms of each model chunk of stage `stage` at full speed, its chunks holding
    `chunk_layers` layers: the embedding runs in the first model chunk (virtual stage 0), the head in the last
    (virtual stage pp x v - 1), and the stage's point-to-point share splits evenly over its chunks (each
    chunk sends and receives once per microbatch)."""
    v, last = len(chunk_layers), terms.shape.pp - 1
    half_p2p = terms.p2p_ms / 2.0 / v
    work = []
    for chunk, layers in enumerate(chunk_layers):
        parts = [(terms.layer, layers)]
        if stage == 0 and chunk == 0:
            parts.append((terms.embedding, 1))
        if stage == last and chunk == v - 1:
            parts.append((terms.head, 1))
        work.append((_forward_ms(parts, 1.0, half_p2p), _backward_ms(parts, 1.0, half_p2p)))
    return tuple(work)


def stage_total_ms(terms: StageCostTerms, stage: int, layers: int, speed: float = 1.0) -> float:
    """`stage_time(...).total_ms` without the memory figures (the planner's search asks for it often)."""
    parts = _stage_parts(terms, stage, layers)
    half_p2p = terms.p2p_ms / 2.0
    return _forward_ms(parts, speed, half_p2p) + _backward_ms(parts, speed, half_p2p)


def stage_backward_ms(terms: StageCostTerms, stage: int, layers: int, speed: float = 1.0) -> float:
    """`stage_time(...).backward_ms` alone."""
    return _backward_ms(_stage_parts(terms, stage, layers), speed, terms.p2p_ms / 2.0)


def stage_forward_ms(terms: StageCostTerms, stage: int, layers: int, speed: float = 1.0) -> float:
    """`stage_time(...).forward_ms` alone."""
    return _forward_ms(_stage_parts(terms, stage, layers), speed, terms.p2p_ms / 2.0)


def stage_weight_grad_ms(terms: StageCostTerms, stage: int, layers: int, speed: float = 1.0) -> float:
    """`stage_time(...).weight_grad_ms` alone."""
    return sum(part.time.weight_grad_ms * count for part, count in _stage_parts(terms, stage, layers)) / speed


def stage_time(terms: StageCostTerms, stage: int, layers: int, speed: float = 1.0) -> StageTime:
    """Stage `stage` holding `layers` layers; compute slows with `speed`, links do not."""
    parts = _stage_parts(terms, stage, layers)
    forward_compute = sum(part.time.forward_compute_ms * count for part, count in parts) / speed
    backward_compute = sum(part.time.backward_compute_ms * count for part, count in parts) / speed
    forward_comm = sum(part.time.forward_tp_comm_ms * count for part, count in parts)
    backward_comm = sum(part.time.backward_tp_comm_ms * count for part, count in parts)
    shard_comm = sum((part.time.forward_shard_comm_ms + part.time.backward_shard_comm_ms) * count for part, count in parts)
    cp_comm = sum((part.time.forward_cp_comm_ms + part.time.backward_cp_comm_ms) * count for part, count in parts)
    ep_comm = sum((part.time.forward_ep_comm_ms + part.time.backward_ep_comm_ms) * count for part, count in parts)
    params = sum(part.params * count for part, count in parts)
    weight_grad = sum(part.time.weight_grad_ms * count for part, count in parts) / speed
    memory = stage_memory(terms, stage, layers)
    half_p2p = terms.p2p_ms / 2.0
    return StageTime(
        forward_ms=_forward_ms(parts, speed, half_p2p),
        backward_ms=_backward_ms(parts, speed, half_p2p),
        compute_ms=forward_compute + backward_compute,
        tp_comm_ms=forward_comm + backward_comm,
        p2p_ms=terms.p2p_ms,
        params=params,
        memory_bytes=memory.peak_bytes(terms.in_flight(stage)),
        weight_grad_ms=weight_grad,
        static_memory_bytes=memory.static_bytes,
        activation_bytes_per_microbatch=memory.per_microbatch_bytes,
        shard_comm_ms=shard_comm,
        cp_comm_ms=cp_comm,
        ep_comm_ms=ep_comm,
    )


def exposed_grad_reduce_ms(terms: StageCostTerms, stage: StageTime) -> float:
    """The gradient all-reduce (ZeRO-1: reduce-scatter) left after the stage's last backward; with the
    overlap, buckets go as they fill during that backward and at least the last one is exposed."""
    if terms.shape.grad_sync_ranks <= 1:
        return 0.0
    bucket_params = min(terms.bucket_params, stage.params)
    return exposed_sync_ms(terms.dp_sync_ms(stage.params), stage.backward_ms, terms.dp_sync_ms(bucket_params),
                           terms.overlap_grad_reduce)


def exposed_param_gather_ms(terms: StageCostTerms, stage: StageTime) -> float:
    """ZeRO-1's all-gather of the updated weights: after the optimizer step, or (overlap_param_gather)
    bucket by bucket under the next iteration's first forward, each layer waiting for its bucket: at
    least the first bucket is exposed, and what the forward cannot cover."""
    if terms.shape.grad_sync_ranks <= 1 or terms.gather_bytes_per_param <= 0.0:
        return 0.0
    bucket_params = min(terms.bucket_params, stage.params)
    return exposed_sync_ms(terms.param_gather_ms(stage.params), stage.forward_ms,
                           terms.param_gather_ms(bucket_params), terms.overlap_param_gather)


def exposed_dp_sync_ms(terms: StageCostTerms, stage: StageTime) -> float:
    """What the stage's data-parallel sync adds to the iteration: the gradient reduction left after the
    backward and the weight all-gather left before (or after) the forward."""
    return exposed_grad_reduce_ms(terms, stage) + exposed_param_gather_ms(terms, stage)


def estimate_iteration(
    terms: StageCostTerms,
    layers_per_stage: Sequence[int],
    stage_speeds: Sequence[float] | None = None,
) -> IterationEstimate:
    """Evaluate one pipeline (the slowest replica of a uniform layout)."""
    speeds = list(stage_speeds) if stage_speeds is not None else [1.0] * len(layers_per_stage)
    stages = tuple(stage_time(terms, i, n, speeds[i]) for i, n in enumerate(layers_per_stage))
    healthy = stages if stage_speeds is None else tuple(stage_time(terms, i, n) for i, n in enumerate(layers_per_stage))
    return iteration_of_stages(terms, stages, healthy)


def iteration_of_stages(terms: StageCostTerms, stages: Sequence[StageTime], healthy: Sequence[StageTime]) -> IterationEstimate:
    """`estimate_iteration` from its stages' timings (`stage_time`) at their speeds and at full speed: callers
    that price many splits of one shape look each stage up once."""
    stages = tuple(stages)
    totals = [s.total_ms for s in stages]
    m = terms.num_microbatches
    pipeline_ms = pipeline_time_ms(totals, m, terms.shape.virtual_stages)
    # Gradient sync waits for the full-speed peers' backward too; their
    # shorter backward hides less of it, so use the speed-1 stage times.
    dp_ms = max(exposed_dp_sync_ms(terms, s) for s in healthy)
    optimizer_ms = max(s.params for s in stages) * terms.optimizer_ms_per_param
    bottleneck = max(range(len(totals)), key=lambda i: totals[i])
    return IterationEstimate(
        stages=stages,
        pipeline_ms=pipeline_ms,
        dp_exposed_ms=dp_ms,
        optimizer_ms=optimizer_ms,
        bottleneck_stage=bottleneck,
        num_microbatches=m,
    )
