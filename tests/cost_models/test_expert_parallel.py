"""Expert parallelism's memory and time terms, from a mixture of experts' published shape.

Mixtral-8x7B (Mistral AI, "Mixtral of experts", Jiang et al. 2024, and its config.json): 32 layers,
hidden 4096, 8 experts of SwiGLU width 14336, top-2, 32 query and 8 KV heads of 128, vocabulary 32000;
46.7B parameters, 12.9B active per token. The expected figures below are written from those numbers,
not from the code under test.
"""

from __future__ import annotations

import pytest

from cost_models.compute import BYTES_PER_ELEMENT
from cost_models.expert_parallel import (
    all_to_all_ms,
    expert_data_parallel,
    expert_parallel_sizes,
    layer_all_to_all_ms,
    layer_params_per_gpu,
)
from cost_models.model_spec import ModelSpec

MIXTRAL = ModelSpec("mixtral-8x7b", num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                    num_kv_heads=8, vocab_size=32000, swiglu=True, tied_embeddings=False, num_experts=8,
                    experts_per_token=2)
ATTENTION = 4096 * (4096 + 2 * 1024) + 4096 * 4096  # Q, K, V and the output projection
ONE_EXPERT = 3 * 4096 * 14336


def test_mixtral_counts_match_the_published_totals():
    assert MIXTRAL.params_per_layer == ATTENTION + 8 * ONE_EXPERT + 4096 * 8 + 2 * 4096
    assert MIXTRAL.total_params == pytest.approx(46.7e9, rel=0.005)
    assert MIXTRAL.active_params == pytest.approx(12.9e9, rel=0.01)


@pytest.mark.parametrize("tp,ep", [(1, 1), (1, 8), (2, 4), (4, 2), (8, 8)])
def test_a_gpu_holds_its_share_of_every_expert(tp, ep):
    dense_part = ATTENTION + 4096 * 8 + 2 * 4096
    assert layer_params_per_gpu(MIXTRAL, tp, ep) == pytest.approx((dense_part + 8 // ep * ONE_EXPERT) / tp)
    # the EP group together holds all eight experts, whatever ep
    assert ep * (layer_params_per_gpu(MIXTRAL, tp, ep) * tp - dense_part) == pytest.approx(8 * ONE_EXPERT)


def test_expert_parallel_sizes_divide_experts_and_replicas():
    assert expert_parallel_sizes(MIXTRAL, 12) == [1, 2, 4]
    assert expert_parallel_sizes(MIXTRAL, 16) == [1, 2, 4, 8]
    dense = ModelSpec("dense", 2, 256, 512, 4, 4, 1000, True, False)
    assert expert_parallel_sizes(dense, 16) == [1]
    assert expert_data_parallel(32, 8) == 4 and expert_data_parallel(4, 8) == 1


def test_all_to_all_moves_the_routed_tokens_that_leave_the_gpu():
    """4096 tokens on tp 2: 2048 per GPU, each to 2 experts, h = 4096 bf16 values: 32 MiB routed, of which
    (ep - 1) / ep leave; in one node over 400 GB/s, across nodes the peers off the node over 50 GB/s."""
    routed = 4096 / 2 * 2 * 4096 * BYTES_PER_ELEMENT
    in_node = all_to_all_ms(MIXTRAL, 4096, 2, 4, 4, 400.0, 50.0)
    assert in_node == pytest.approx(1e3 * routed * 3 / 4 / 400e9)
    # ep 8 with 4 peers per node: 3/8 of the bytes over NVLink, 4/8 over the network (the slower share)
    across = all_to_all_ms(MIXTRAL, 4096, 2, 8, 4, 400.0, 50.0)
    assert across == pytest.approx(1e3 * routed * 4 / 8 / 50e9)
    assert layer_all_to_all_ms(MIXTRAL, 4096, 2, 8, 4, 400.0, 50.0) == pytest.approx(2 * across)
    assert all_to_all_ms(MIXTRAL, 4096, 2, 1, 4, 400.0, 50.0) == 0.0
