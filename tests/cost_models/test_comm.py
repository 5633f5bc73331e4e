"""Ring collectives in the alpha-beta model (Patarasuk & Yuan; NCCL's ring algorithm)."""

from __future__ import annotations

import pytest

from cost_models.comm import (
    NETWORK_STEP_LATENCY_S,
    NVLINK_STEP_LATENCY_S,
    hierarchical_all_reduce_s,
    point_to_point_s,
    ring_all_gather_s,
    ring_all_reduce_s,
)


def test_latency_constants_are_microseconds():
    # a few us per NVLink hop, ~10 us across InfiniBand (documented, not fitted)
    assert 1e-6 <= NVLINK_STEP_LATENCY_S <= 1e-5
    assert 5e-6 <= NETWORK_STEP_LATENCY_S <= 2e-5
    assert NVLINK_STEP_LATENCY_S < NETWORK_STEP_LATENCY_S


@pytest.mark.parametrize("n", [2, 4, 8, 64])
def test_ring_all_reduce(n):
    nbytes, bw, lat = 1e9, 100.0, 5e-6
    # each rank sends 2 (n-1)/n of the buffer over 2 (n-1) steps
    expected = 2 * (n - 1) / n * nbytes / (bw * 1e9) + 2 * (n - 1) * lat
    assert ring_all_reduce_s(nbytes, n, bw, lat) == pytest.approx(expected, rel=1e-12)


def test_ring_all_reduce_numbers():
    # 1 GB over 8 ranks at 100 GB/s: 1.75 * 10 ms = 17.5 ms, plus 14 * 5 us = 0.07 ms
    assert ring_all_reduce_s(1e9, 8, 100.0, 5e-6) == pytest.approx(0.0175 + 0.00007, rel=1e-12)


@pytest.mark.parametrize("n", [2, 8, 16])
def test_ring_all_gather(n):
    nbytes, bw, lat = 3e8, 50.0, 2e-6
    # (n-1)/n of the buffer in n-1 steps
    expected = (n - 1) / n * nbytes / (bw * 1e9) + (n - 1) * lat
    assert ring_all_gather_s(nbytes, n, bw, lat) == pytest.approx(expected, rel=1e-12)


def test_single_rank_or_empty_buffer_is_free():
    assert ring_all_reduce_s(1e9, 1, 100.0, 5e-6) == 0.0
    assert ring_all_gather_s(1e9, 1, 100.0, 5e-6) == 0.0
    assert ring_all_reduce_s(0.0, 8, 100.0, 5e-6) == 0.0
    assert hierarchical_all_reduce_s(1e9, 1, 8, 300.0, 25.0) == 0.0


@pytest.mark.parametrize("n", [2, 4, 8])
def test_hierarchical_all_ranks_in_one_node_is_nvlink_ring(n):
    nbytes, intra, inter = 2e9, 300.0, 25.0
    # reduce-scatter + all-gather over NVLink == ring all-reduce over NVLink; no network part
    expected = 2 * (n - 1) / n * nbytes / (intra * 1e9) + 2 * (n - 1) * NVLINK_STEP_LATENCY_S
    assert hierarchical_all_reduce_s(nbytes, n, 8, intra, inter) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("n", [2, 4, 16])
def test_hierarchical_one_rank_per_node_is_network_ring(n):
    nbytes, intra, inter = 2e9, 300.0, 25.0
    expected = 2 * (n - 1) / n * nbytes / (inter * 1e9) + 2 * (n - 1) * NETWORK_STEP_LATENCY_S
    assert hierarchical_all_reduce_s(nbytes, n, 1, intra, inter) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("ranks,k", [(16, 8), (32, 4), (6, 2)])
def test_hierarchical_k_per_node_carries_bytes_over_k(ranks, k):
    nbytes, intra, inter = 1e9, 300.0, 25.0
    nodes = ranks // k
    # intra: reduce-scatter then all-gather inside the node, each (k-1)/k of the buffer
    intra_s = 2 * ((k - 1) / k * nbytes / (intra * 1e9) + (k - 1) * NVLINK_STEP_LATENCY_S)
    # inter: ring all-reduce of a 1/k shard across the nodes (k NICs in parallel)
    inter_s = 2 * (nodes - 1) / nodes * (nbytes / k) / (inter * 1e9) + 2 * (nodes - 1) * NETWORK_STEP_LATENCY_S
    assert hierarchical_all_reduce_s(nbytes, ranks, k, intra, inter) == pytest.approx(intra_s + inter_s, rel=1e-12)


def test_hierarchical_16_ranks_8_per_node_numbers():
    # 1 GB, 2 nodes of 8: intra 2 * (7/8 * 1e9 / 300e9) = 5.8333 ms + 14 NVLink hops;
    # inter: 2 * 1/2 * 125 MB / 25 GB/s = 5 ms + 2 network hops
    expected = 2 * 7 / 8 / 300.0 + 14 * NVLINK_STEP_LATENCY_S + 0.005 + 2 * NETWORK_STEP_LATENCY_S
    assert hierarchical_all_reduce_s(1e9, 16, 8, 300.0, 25.0) == pytest.approx(expected, rel=1e-12)


def test_point_to_point():
    # 100 MB at 25 GB/s = 4 ms, plus latency
    assert point_to_point_s(1e8, 25.0, 1e-5) == pytest.approx(0.004 + 1e-5, rel=1e-12)
    assert point_to_point_s(0.0, 25.0, 1e-5) == 0.0
