"""Collective and point-to-point transfer times (ring algorithms, alpha-beta model)."""

from __future__ import annotations

# Per-step startup latency of a ring collective or a send, seconds. NCCL's
# published per-hop latencies are a few microseconds on NVLink and ~10 us
# across InfiniBand; fixed, not fitted.
NVLINK_STEP_LATENCY_S = 3e-6
NETWORK_STEP_LATENCY_S = 10e-6


def ring_all_reduce_s(bytes_total: float, ranks: int, bandwidth_gb_s: float, step_latency_s: float) -> float:
    """Ring all-reduce: each rank sends 2 (n-1)/n of the buffer, in 2 (n-1) steps."""
    if ranks <= 1 or bytes_total <= 0:
        return 0.0
    steps = 2 * (ranks - 1)
    return steps / ranks * bytes_total / (bandwidth_gb_s * 1e9) + steps * step_latency_s


def ring_all_gather_s(bytes_total: float, ranks: int, bandwidth_gb_s: float, step_latency_s: float) -> float:
    """Ring all-gather (or reduce-scatter) of a buffer of `bytes_total` on every rank."""
    if ranks <= 1 or bytes_total <= 0:
        return 0.0
    steps = ranks - 1
    return steps / ranks * bytes_total / (bandwidth_gb_s * 1e9) + steps * step_latency_s


def _node_split(ranks: int, ranks_per_node: int) -> tuple[int, int]:
    """(ranks in each node, nodes) of `ranks` placed `ranks_per_node` to a node."""
    per_node = max(1, min(ranks_per_node, ranks))
    return per_node, -(-ranks // per_node)


def hierarchical_all_reduce_s(
    bytes_total: float,
    ranks: int,
    ranks_per_node: int,
    intra_bandwidth_gb_s: float,
    inter_bandwidth_gb_s: float,
) -> float:
    """All-reduce over `ranks` spread as `ranks_per_node` per node.

    Reduce-scatter inside the node over NVLink, all-reduce of each 1/k shard
    across nodes (the k GPUs use their own NICs in parallel), all-gather
    inside the node. With one rank per node this is a plain ring over the
    network; with all ranks in one node, a ring over NVLink.
    """
    if ranks <= 1:
        return 0.0
    per_node, nodes = _node_split(ranks, ranks_per_node)
    intra = 2 * ring_all_gather_s(bytes_total, per_node, intra_bandwidth_gb_s, NVLINK_STEP_LATENCY_S)
    inter = ring_all_reduce_s(bytes_total / per_node, nodes, inter_bandwidth_gb_s, NETWORK_STEP_LATENCY_S)
    return intra + inter


def hierarchical_all_gather_s(
    bytes_total: float,
    ranks: int,
    ranks_per_node: int,
    intra_bandwidth_gb_s: float,
    inter_bandwidth_gb_s: float,
) -> float:
    """All-gather (or reduce-scatter) of a `bytes_total` buffer over `ranks` spread as `ranks_per_node`
    per node: the 1/k shards across nodes (the k GPUs on their own NICs in parallel), then inside the
    node over NVLink; half of `hierarchical_all_reduce_s`, latency included."""
    if ranks <= 1:
        return 0.0
    per_node, nodes = _node_split(ranks, ranks_per_node)
    intra = ring_all_gather_s(bytes_total, per_node, intra_bandwidth_gb_s, NVLINK_STEP_LATENCY_S)
    inter = ring_all_gather_s(bytes_total / per_node, nodes, inter_bandwidth_gb_s, NETWORK_STEP_LATENCY_S)
    return intra + inter


def point_to_point_s(bytes_total: float, bandwidth_gb_s: float, latency_s: float) -> float:
    if bytes_total <= 0:
        return 0.0
    return bytes_total / (bandwidth_gb_s * 1e9) + latency_s
