"""Model FLOPs (Narayanan et al. SC'21 convention: a multiply-add is 2 FLOPs).

The attention-score term counts the full s x s matrix, as the published
formula does, even though a causal kernel may skip half of it; execution
time accounts for that separately (`layer_time`).
"""

from __future__ import annotations

from cost_models.choices import Recompute
from cost_models.model_spec import ModelSpec


def layer_matmul_forward_flops(model: ModelSpec, seq_length: int, micro_batch: int) -> float:
    """Dense projections of one layer, forward: QKV, output, MLP."""
    tokens = seq_length * micro_batch
    h = model.hidden_size
    qkv = 2 * tokens * h * (h + 2 * model.kv_width)
    out_proj = 2 * tokens * h * h
    mlp_matrices = 3 if model.swiglu else 2
    mlp = mlp_matrices * 2 * tokens * h * model.ffn_hidden_size
    return float(qkv + out_proj + mlp)


def layer_attention_forward_flops(model: ModelSpec, seq_length: int, micro_batch: int) -> float:
    """Q K^T and scores x V of one layer, forward (quadratic in seq_length)."""
    return float(4 * micro_batch * seq_length * seq_length * model.hidden_size)


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
    per_sequence_forward = model.num_layers * layer_forward_flops(model, seq_length, 1) + head_forward_flops(
        model, seq_length, 1
    )
    return (1 + BACKWARD_TO_FORWARD) * per_sequence_forward * global_batch


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
