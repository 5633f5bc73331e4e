"""The cost of non-uniform layouts.

Pipeline time of a replica with unequal stages is `pipeline.pipeline_time_ms`
(bottleneck stage x microbatches + fill and drain). What changes when replicas
differ is gradient synchronization: when replicas hold a layer with different
TP shardings or stage boundaries, the intra-node reduce-scatter / all-gather of
the hierarchical all-reduce no longer lines up, so every GPU all-reduces its
own shard with the GPUs of the other replicas holding the same layer, over
the network, one ring per layer (the resharding all-reduce). A GPU of a
lower-TP stage holds a bigger shard and so moves more bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from cost_models.comm import NETWORK_STEP_LATENCY_S, ring_all_reduce_s
from cost_models.pipeline import pipeline_time_ms


def resharded_sync_ms(
    params_per_gpu: float,
    layers: int,
    replicas: int,
    sync_bytes_per_param: float,
    network_bandwidth_gb_s: float,
) -> float:
    """Gradient sync (or, at ZeRO-1's gather bytes, the weight all-gather) of one GPU's shard when replicas
    are sharded differently.

    Bandwidth: a flat ring over `replicas` of the GPU's whole gradient shard.
    Latency: one ring per layer (the groups differ layer by layer).
    """
    if replicas <= 1 or params_per_gpu <= 0 or sync_bytes_per_param <= 0:
        return 0.0
    bandwidth_s = ring_all_reduce_s(params_per_gpu * sync_bytes_per_param, replicas, network_bandwidth_gb_s, 0.0)
    latency_s = max(1, layers) * 2 * (replicas - 1) * NETWORK_STEP_LATENCY_S
    return 1e3 * (bandwidth_s + latency_s)


def exposed_sync_ms(sync_ms: float, overlapped_ms: float, last_bucket_ms: float, overlap: bool) -> float:
    """Sync left after the compute it overlaps (the gradient reduction: the last microbatch's backward; the
    weight all-gather: the first forward); at least one bucket when overlapped, all of it when not."""
    if not overlap:
        return sync_ms
    return max(sync_ms - overlapped_ms, min(sync_ms, last_bucket_ms))


def nonuniform_iteration_ms(
    replicas: Sequence[tuple[Sequence[float], int]],
    virtual_stages: int,
    exposed_sync_ms_per_stage: Sequence[float],
    optimizer_ms_per_stage: Sequence[float],
) -> float:
    """Iteration of replicas that differ: the slowest replica's pipeline, then the
    slowest stage's exposed gradient sync and optimizer step.

    replicas: (stage times per microbatch in ms, microbatches) per replica.
    """
    pipeline = max(pipeline_time_ms(times, m, virtual_stages) for times, m in replicas if m > 0)
    return pipeline + max(exposed_sync_ms_per_stage, default=0.0) + max(optimizer_ms_per_stage, default=0.0)
