"""DeepSeek-V2/V3's multi-head latent attention and dense layers among the experts, priced by hand.

The FLOPs of a token's projections are twice the weights it multiplies (a multiply-add per weight), counted
here module by module from the published architecture (DeepSeek-V3 technical report, its config.json); the
attention core multiplies each query by every key (192 = 128 + 64 wide per head) and the scores by every value
(128 wide). What the planner's stage model simplifies is checked as the bound it claims to be.
"""

from __future__ import annotations

import dataclasses

import pytest

from cost_models.expert_parallel import all_to_all_ms, layer_params_per_gpu
from cost_models.flops import layer_attention_forward_flops, layer_projection_gemms
from cost_models.model_spec import model_preset

H, HEADS = 7168, 128
# DeepSeek-V3's attention matrices, one layer: q down (to the 1536 latent) and up (to 128 heads of 128 + 64), kv
# down (to the 512 latent and the 64 shared rotary dimensions) and up (to 128 keys of 128 and values of 128),
# output (128 values of 128 back to the hidden size)
Q_DOWN, Q_UP = H * 1536, 1536 * HEADS * 192
KV_DOWN, KV_UP = H * (512 + 64), 512 * HEADS * (128 + 128)
OUT = HEADS * 128 * H
ATTENTION_MATRICES = Q_DOWN + Q_UP + KV_DOWN + KV_UP + OUT


def test_a_tokens_projection_flops_are_twice_the_weights_it_multiplies():
    v3 = model_preset("deepseek-v3")
    per_layer = sum(flops for flops, _ in layer_projection_gemms(v3, 1, 1))
    dense_mlp, expert_mlp = 3 * H * 18432, (8 + 1) * 3 * H * 2048  # 8 routed experts and the shared one
    router = H * 256
    every_layer = 61 * ATTENTION_MATRICES + 3 * dense_mlp + 58 * (expert_mlp + router)
    assert 61 * per_layer == pytest.approx(2 * every_layer, rel=1e-12)


def test_latent_attention_scores_queries_against_wider_keys_than_its_values():
    v3 = model_preset("deepseek-v3")
    s = 4096
    assert layer_attention_forward_flops(v3, s, 1) == 2 * s * s * HEADS * 192 + 2 * s * s * HEADS * 128


def test_the_down_projections_run_whole_on_every_tp_rank():
    """Transformer Engine's duplicated linears (Megatron's DeepSeek recipes): TP splits only the heads' side."""
    v3 = model_preset("deepseek-v3")
    attention = sum(flops for flops, _ in layer_projection_gemms(v3, 1, 8)[:5])  # q, kv down and up, output
    assert attention == pytest.approx(2 * (Q_DOWN + KV_DOWN) + 2 * (Q_UP + KV_UP + OUT) / 8, rel=1e-12)


def test_a_stage_prices_each_layer_at_the_larger_kind_per_gpu():
    """A stage may hold dense layers (DeepSeek-V3's first 3) or expert ones: each is priced at the larger of the
    two on one GPU, so no stage is undercounted wherever the split falls."""
    v3 = model_preset("deepseek-v3")
    attention_and_norms = ATTENTION_MATRICES + 1536 + 512 + 2 * H
    dense = attention_and_norms + 3 * H * 18432
    expert = attention_and_norms + H * 256 + 256 * 3 * H * 2048 + 3 * H * 2048
    assert (v3.dense_layer_params, v3.params_per_layer) == (dense, expert)
    assert layer_params_per_gpu(v3, 1, 1) == expert  # whole experts outweigh a dense MLP
    assert layer_params_per_gpu(v3, 2, 8) == pytest.approx((expert - 224 * 3 * H * 2048) / 2)  # 32 experts a GPU
    assert layer_params_per_gpu(v3, 2, 64) == dense / 2  # 4 experts a GPU: the dense layer is the larger


def test_dense_layers_send_no_tokens_to_experts():
    v2_lite = model_preset("deepseek-v2-lite")
    all_expert = dataclasses.replace(v2_lite, dense_layers=0, dense_ffn_hidden_size=0)
    priced = all_to_all_ms(v2_lite, 8192, 1, 8, 8, 400.0, 50.0)
    assert priced == pytest.approx(all_to_all_ms(all_expert, 8192, 1, 8, 8, 400.0, 50.0) * 26 / 27, rel=1e-12)
    # and a token's MLP width is the mean over the layers: 26 of 6 routed and 2 shared experts, 1 dense
    assert v2_lite.mlp_width_per_token == pytest.approx((26 * 8 * 1408 + 10944) / 27, rel=1e-12)


def test_the_last_stage_carries_the_multi_token_prediction_depths():
    """DeepSeek-V2-Lite with one MTP depth on tp 2: the head part gains one expert layer's weights per GPU, the
    2h x h projection split over TP and three norms, and a layer's, the projection's and the head's time; the
    iteration's model FLOPs gain per token the projection (2 x 2h x h), a layer and the head once more."""
    from cost_models.efficiency import EfficiencyParams, SoftwareConfig
    from cost_models.flops import head_forward_flops, iteration_model_flops, layer_forward_flops
    from cost_models.hardware import gpu_preset
    from cost_models.layout import Hardware, ParallelShape, Workload
    from cost_models.stage_costs import part_costs

    plain = model_preset("deepseek-v2-lite")
    mtp = dataclasses.replace(plain, mtp_layers=1)
    h, s = plain.hidden_size, 4096
    gpu = gpu_preset("H100-SXM")
    hardware = Hardware(gpu=gpu, gpus_per_node=8, intra_node_bandwidth_gb_s=450.0, inter_node_bandwidth_gb_s=50.0)
    shape = ParallelShape(tp=2, pp=2, dp=4, micro_batch_size=1, recompute="none", ep=4)
    parts = {m.mtp_layers: part_costs(Workload(m, s, 64), hardware, shape, EfficiencyParams(), SoftwareConfig())
             for m in (plain, mtp)}
    layer = parts[0].layer
    assert parts[1].head.params - parts[0].head.params == pytest.approx(layer.params + 2 * h * h / 2 + 3 * h)
    assert parts[1].layer == layer and parts[1].embedding == parts[0].embedding
    extra_ms = parts[1].head.time.forward_compute_ms - parts[0].head.time.forward_compute_ms
    assert extra_ms > layer.time.forward_compute_ms + parts[0].head.time.forward_compute_ms
    assert mtp.total_params - plain.total_params == plain.params_per_layer + 2 * h * h + 3 * h
    per_sequence = 2 * s * 2 * h * h + layer_forward_flops(plain, s, 1) + head_forward_flops(plain, s, 1)
    assert iteration_model_flops(mtp, s, 64) - iteration_model_flops(plain, s, 64) == pytest.approx(3 * per_sequence * 64)


def test_a_tied_head_on_one_stage_keeps_its_multi_token_prediction_weights():
    """With pp 1 a tied output head shares the embedding's table, which the stage then counts once; the
    multi-token-prediction depth's own weights stay on it."""
    from cost_models.efficiency import EfficiencyParams, SoftwareConfig
    from cost_models.hardware import gpu_preset
    from cost_models.layout import Hardware, ParallelShape, Workload
    from cost_models.stage_costs import stage_cost_terms

    tied = dataclasses.replace(model_preset("llama3-8b"), tied_embeddings=True)
    gpu = gpu_preset("H100-SXM")
    hardware = Hardware(gpu=gpu, gpus_per_node=8, intra_node_bandwidth_gb_s=450.0, inter_node_bandwidth_gb_s=50.0)
    shape = ParallelShape(tp=2, pp=1, dp=4, micro_batch_size=1, recompute="none")
    heads = {m: stage_cost_terms(Workload(tied if m == 0 else dataclasses.replace(tied, mtp_layers=m), 4096, 32),
                                 hardware, shape, EfficiencyParams(), SoftwareConfig()).head.params for m in (0, 1)}
    h = tied.hidden_size
    assert heads[0] == h  # the final norm: the table is the embedding's
    assert heads[1] - heads[0] == pytest.approx(tied.params_per_layer / 2 + 2 * h * h / 2 + 3 * h)
