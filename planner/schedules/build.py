"""A replica of a plan as a PipelineSpec: per-chunk op times, activations and the memory left for them."""

from __future__ import annotations

from planner.result import ReplicaResult
from planner.schedules.ops import ChunkShare, ChunkTimes, PipelineSpec


def replica_spec(replica: ReplicaResult, virtual_stages: int, gpu_memory_gib: float) -> PipelineSpec:
    """Split each stage's times and activations over its v chunks: evenly, or by the stage's `chunk_shares`
    where its chunks hold uneven layer counts.

    Op times already include the stage's share of the point-to-point
    transfers (Megatron's 1F1B waits for its send/recv pairs), so the links
    add no separate latency here; that keeps the simulated 1F1B of equal
    stages equal to the (m + p - 1)(f + b) the search optimizes.
    """
    v = virtual_stages
    chunks = []
    even = (ChunkShare(1 / v, 1 / v, 1 / v),) * v
    for stage in replica.stages:
        input_grad_ms = max(0.0, stage.backward_ms - stage.weight_grad_ms)
        chunks.append(tuple(
            ChunkTimes(
                forward_ms=stage.forward_ms * share.forward,
                input_grad_ms=input_grad_ms * share.backward,
                weight_grad_ms=stage.weight_grad_ms * share.backward,
                activation_gib=stage.activation_gib * share.activation,
            )
            for share in stage.chunk_shares or even))
    limits = tuple(max(0.0, gpu_memory_gib - stage.static_memory_gib) for stage in replica.stages)
    syncs = tuple(stage.grad_sync for stage in replica.stages)
    return PipelineSpec(
        chunks=tuple(chunks),
        num_microbatches=replica.num_microbatches,
        p2p_latency_ms=0.0,
        activation_limit_gib=limits,
        grad_sync=syncs if all(sync is not None for sync in syncs) else None,
    )


def timeline_signature(replica: ReplicaResult) -> tuple:
    """Replicas with equal signatures run identical timelines."""
    return replica.num_microbatches, tuple(
        (s.forward_ms, s.backward_ms, s.weight_grad_ms, s.activation_gib, s.static_memory_gib, s.chunk_shares)
        for s in replica.stages
    )
