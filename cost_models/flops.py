"""Model FLOPs (Narayanan et al. SC'21 convention: a multiply-add is 2 FLOPs).

The attention-score term counts the full s x s matrix, as the published
formula does, even though a causal kernel may skip half of it; execution
time accounts for that separately (`layer_time`).
"""

from __future__ import annotations

from cost_models.choices import Recompute
from cost_models.model_spec import ModelSpec


def layer_matmul_forward_flops(model: ModelSpec, seq_length: int, micro_batch: int) -> float:
    """Projections of one layer, forward: QKV, output, MLP (a mixture of experts': the router, the
    experts each token is routed to and the shared experts)."""
    return float(sum(flops for flops, _ in layer_projection_gemms(model, seq_length * micro_batch, 1)))


def layer_projection_gemms(model: ModelSpec, tokens: float, tp: int,
                           expert_tp: int | None = None) -> tuple[tuple[float, float], ...]:
    """(FLOPs, narrow width) of each projection GEMM of one layer's forward on one GPU of a TP group:
    QKV (latent attention's down and up projections), output projection, the MLP's first (gate and up with
    SwiGLU) and second matrices, and a mixture of experts' router. A routed expert's GEMMs are as wide as
    one expert (`ffn_hidden_size`) split over `expert_tp` ranks (default tp), while their FLOPs count every
    expert a token runs (`mlp_width_per_token`) over tp: with expert-TP below TP a GPU runs whole (wider)
    expert shards on the routed tokens of tp / expert_tp TP ranks, the same FLOPs."""
    h, out = model.hidden_size, model.attention_output_width
    gemms = (_qkv_gemms(model, tokens, tp) + ((2 * tokens * (out / tp) * h, min(h, out / tp)),)
             + mlp_projection_gemms(model, tokens, tp, expert_tp))
    if model.is_moe:  # replicated on every TP rank, as Megatron's router is; per mean layer (dense ones have none)
        share = model.expert_layers / model.num_layers
        gemms += ((2 * tokens * h * model.num_experts * share, min(h, model.num_experts)),)
    return gemms


def mlp_projection_gemms(model: ModelSpec, tokens: float, tp: int,
                         expert_tp: int | None = None) -> tuple[tuple[float, float], ...]:
    """(FLOPs, narrow width) of the MLP's two GEMMs (`layer_projection_gemms`): a mixture of experts' the
    routed and shared experts'."""
    h = model.hidden_size
    gate_up = 2 if model.swiglu else 1
    per_token = model.mlp_width_per_token / tp
    one_gemm = model.ffn_hidden_size / (expert_tp if model.is_moe and expert_tp else tp)
    return ((2 * tokens * h * gate_up * per_token, min(h, gate_up * one_gemm)),
            (2 * tokens * per_token * h, min(h, one_gemm)))


def _qkv_gemms(model: ModelSpec, tokens: float, tp: int) -> tuple[tuple[float, float], ...]:
    """The Q, K and V projections: one GEMM, or latent attention's down projections (whole on every TP
    rank, as Transformer Engine's duplicated linears run them in Megatron's DeepSeek recipes) and up
    projections (split by heads over TP)."""
    h = model.hidden_size
    if not model.is_mla:
        qkv_out = (model.q_width + 2 * model.kv_width) / tp
        return ((2 * tokens * h * qkv_out, min(h, qkv_out)),)
    q_heads = model.q_width / tp
    kv_heads = model.num_attention_heads * (model.head_width + (model.v_head_dim or model.head_width)) / tp
    kv_down = model.kv_lora_rank + model.qk_rope_head_dim
    gemms = ((2 * tokens * h * kv_down, min(h, kv_down)),
             (2 * tokens * model.kv_lora_rank * kv_heads, min(model.kv_lora_rank, kv_heads)))
    if not model.q_lora_rank:
        return gemms + ((2 * tokens * h * q_heads, min(h, q_heads)),)
    rank = model.q_lora_rank
    return gemms + ((2 * tokens * h * rank, min(h, rank)), (2 * tokens * rank * q_heads, min(rank, q_heads)))


def layer_attention_forward_flops(model: ModelSpec, seq_length: int, micro_batch: int) -> float:
    """Q K^T and scores x V of one layer, forward (quadratic in seq_length; the values as wide as the attention's
    output, narrower than the keys with latent attention): every query against every
    key, or with sliding windows against the keys it may see, averaged over the layers
    (`ModelSpec.attended_keys_fraction`)."""
    flops = float(2 * micro_batch * seq_length * seq_length * (model.q_width + model.attention_output_width))
    return flops if model.sliding_window is None else flops * model.attended_keys_fraction(seq_length)


def attention_executed_fraction(model: ModelSpec, seq_length: int, causal_fraction: float) -> float:
    """Share of `layer_attention_forward_flops` a causal kernel executes: `causal_fraction` of a whole layer's
    matrix (the upper triangle skipped), and in a windowed layer the band of keys each query sees, all of
    it but the first tokens' triangle (w s - w (w - 1) / 2 of w s pairs)."""
    windowed = model.windowed_layers
    if not windowed:
        return causal_fraction
    s, w = seq_length, min(model.sliding_window, seq_length)
    full = model.num_layers - windowed
    executed = full * causal_fraction * s * s + windowed * (w * s - w * (w - 1) / 2)
    return executed / (full * s * s + windowed * w * s)


def layer_forward_flops(model: ModelSpec, seq_length: int, micro_batch: int) -> float:
    return layer_matmul_forward_flops(model, seq_length, micro_batch) + layer_attention_forward_flops(
        model, seq_length, micro_batch
    )


def head_forward_flops(model: ModelSpec, seq_length: int, micro_batch: int) -> float:
    """Output projection to the vocabulary (logits), forward."""
    return float(2 * seq_length * micro_batch * model.hidden_size * model.vocab_size)


BACKWARD_TO_FORWARD = 2.0  # gradients w.r.t. inputs and w.r.t. weights: one forward each


def iteration_model_flops(model: ModelSpec, seq_length: int, global_batch: int) -> float:
    """Model FLOPs of one training iteration, without recomputation.

    Equals 72 B s L h^2 (1 + s/(6h) + V/(12 L h)) for standard attention with
    ffn = 4h (SC'21 eq. 3 with the head's backward counted).
    """
    per_sequence_forward = (model.num_layers * layer_forward_flops(model, seq_length, 1)
                            + head_forward_flops(model, seq_length, 1) + mtp_forward_flops(model, seq_length, 1))
    return (1 + BACKWARD_TO_FORWARD) * per_sequence_forward * global_batch


def mtp_forward_flops(model: ModelSpec, seq_length: int, micro_batch: int) -> float:
    """The multi-token-prediction depths, forward: each a projection of 2h to h, a layer and the output head."""
    tokens = seq_length * micro_batch
    per_depth = (2 * tokens * 2 * model.hidden_size * model.hidden_size + layer_forward_flops(model, seq_length, micro_batch)
                 + head_forward_flops(model, seq_length, micro_batch))
    return model.mtp_layers * per_depth


def recompute_extra_flops(model: ModelSpec, seq_length: int, global_batch: int, recompute: str) -> float:
    """FLOPs spent again on recomputation per iteration (hardware FLOPs minus model FLOPs).

    full: a whole forward of every layer; selective: the attention core
    (Korthikanti et al. 2022); none: nothing.
    """
    if recompute == Recompute.FULL:
        return model.num_layers * layer_forward_flops(model, seq_length, 1) * global_batch
    if recompute == Recompute.SELECTIVE:
        return model.num_layers * layer_attention_forward_flops(model, seq_length, 1) * global_batch
    return 0.0
