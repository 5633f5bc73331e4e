"""Model FLOPs against Narayanan et al. SC'21 (eq. 3) and its generalizations.

Convention: a multiply-add is 2 FLOPs; backward = 2 x forward.
"""

from __future__ import annotations

import pytest

from cost_models.flops import (
    head_forward_flops,
    iteration_model_flops,
    layer_attention_forward_flops,
    layer_forward_flops,
    layer_matmul_forward_flops,
    recompute_extra_flops,
)
from cost_models.model_spec import ModelSpec, model_preset


def gpt(num_layers: int, hidden: int, heads: int, vocab: int) -> ModelSpec:
    """GPT-3 style: ffn = 4h, multi-head attention, GELU MLP."""
    return ModelSpec(
        name="gpt",
        num_layers=num_layers,
        hidden_size=hidden,
        ffn_hidden_size=4 * hidden,
        num_attention_heads=heads,
        num_kv_heads=heads,
        vocab_size=vocab,
        swiglu=False,
        tied_embeddings=True,
    )


GPT_SHAPES = [
    # (L, h, a, V, s, B)
    (96, 12288, 96, 51200, 2048, 1536),  # GPT-3 175B as in SC'21 Table 1
    (24, 2048, 16, 51200, 2048, 512),  # GPT 1.3B
    (2, 256, 4, 1000, 128, 3),  # small, attention term large relative to h
]


@pytest.mark.parametrize("L,h,a,V,s,B", GPT_SHAPES)
def test_iteration_flops_equal_sc21_formula(L, h, a, V, s, B):
    model = gpt(L, h, a, V)
    # SC'21 eq. 3: 72 B s L h^2 (1 + s/(6h) + V/(12 L h))
    expected = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
    assert iteration_model_flops(model, s, B) == pytest.approx(expected, rel=1e-12)


def test_gpt3_preset_iteration_flops():
    model = model_preset("gpt3-175b")
    L, h, V, s, B = 96, 12288, 50257, 2048, 1536
    expected = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
    assert iteration_model_flops(model, s, B) == pytest.approx(expected, rel=1e-12)


def test_gqa_reduces_qkv_projection():
    # Llama-like attention: h = 4096, 32 query heads of 128, 8 kv heads; plain MLP f = 4h.
    h, a, kv, f, s, b = 4096, 32, 8, 4 * 4096, 1024, 2
    head_dim = h // a  # 128
    gqa = ModelSpec("gqa", 4, h, f, a, kv, 32000, swiglu=False, tied_embeddings=False)
    mha = ModelSpec("mha", 4, h, f, a, a, 32000, swiglu=False, tied_embeddings=False)
    tokens = s * b
    # QKV: 2 T h (h + 2 kv head_dim); output projection 2 T h^2; MLP two matrices 2 * 2 T h f
    expected_gqa = 2 * tokens * h * (h + 2 * kv * head_dim) + 2 * tokens * h * h + 4 * tokens * h * f
    assert layer_matmul_forward_flops(gqa, s, b) == pytest.approx(expected_gqa, rel=1e-12)
    # MHA QKV is 2 T h (3h): the saving is 2 T h * 2 (a - kv) head_dim
    saving = 2 * tokens * h * 2 * (a - kv) * head_dim
    assert layer_matmul_forward_flops(mha, s, b) - layer_matmul_forward_flops(gqa, s, b) == pytest.approx(
        saving, rel=1e-12
    )
    # and MHA matches the classic 24 T h^2 for f = 4h
    assert layer_matmul_forward_flops(mha, s, b) == pytest.approx(24 * tokens * h**2, rel=1e-12)


def test_swiglu_mlp_has_three_matrices():
    h, f, s, b = 4096, 11008, 512, 1
    gated = ModelSpec("g", 1, h, f, 32, 32, 32000, swiglu=True, tied_embeddings=False)
    plain = ModelSpec("p", 1, h, f, 32, 32, 32000, swiglu=False, tied_embeddings=False)
    tokens = s * b
    attn_proj = 2 * tokens * h * (3 * h) + 2 * tokens * h * h  # QKV + output, MHA
    assert layer_matmul_forward_flops(gated, s, b) == pytest.approx(attn_proj + 6 * tokens * h * f, rel=1e-12)
    assert layer_matmul_forward_flops(plain, s, b) == pytest.approx(attn_proj + 4 * tokens * h * f, rel=1e-12)


@pytest.mark.parametrize("s,b", [(2048, 1), (4096, 3), (128, 8)])
def test_attention_and_head_terms(s, b):
    model = gpt(8, 1536, 12, 50257)
    h, V = 1536, 50257
    # Q K^T and scores x V: 2 * 2 b s^2 h
    assert layer_attention_forward_flops(model, s, b) == pytest.approx(4 * b * s**2 * h, rel=1e-12)
    # logits: 2 s b h V
    assert head_forward_flops(model, s, b) == pytest.approx(2 * s * b * h * V, rel=1e-12)
    # whole layer forward for ffn = 4h: 24 s b h^2 + 4 b s^2 h
    assert layer_forward_flops(model, s, b) == pytest.approx(24 * s * b * h**2 + 4 * b * s**2 * h, rel=1e-12)


@pytest.mark.parametrize("L,h,a,V,s,B", GPT_SHAPES)
def test_full_recompute_adds_one_forward_of_all_layers(L, h, a, V, s, B):
    model = gpt(L, h, a, V)
    # one forward of every layer: B L (24 s h^2 + 4 s^2 h); the head is not recomputed
    expected = B * L * (24 * s * h**2 + 4 * s**2 * h)
    assert recompute_extra_flops(model, s, B, "full") == pytest.approx(expected, rel=1e-12)
    # model + recompute FLOPs give SC'21's hardware form 96 B s L h^2 (1 + s/(6h) + V/(16 L h))
    hardware = 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    total = iteration_model_flops(model, s, B) + recompute_extra_flops(model, s, B, "full")
    assert total == pytest.approx(hardware, rel=1e-12)


@pytest.mark.parametrize("L,h,a,V,s,B", GPT_SHAPES)
def test_selective_recompute_is_attention_core_only(L, h, a, V, s, B):
    model = gpt(L, h, a, V)
    # Korthikanti et al.: only Q K^T, softmax, scores x V are recomputed: B L 4 s^2 h
    assert recompute_extra_flops(model, s, B, "selective") == pytest.approx(B * L * 4 * s**2 * h, rel=1e-12)
    assert recompute_extra_flops(model, s, B, "none") == 0.0


def test_sliding_windows_count_the_keys_each_query_sees():
    """GPT-OSS-120B at 8k tokens: 18 of its 36 layers see every key, 18 a window of 128; the executed work of a
    causal kernel is half of a full layer's matrix and, in a windowed layer, 128 keys per query but for the first
    127 queries' triangle. Written from those numbers, not from the code."""
    from cost_models.compute import CAUSAL_EXECUTED_FRACTION
    from cost_models.flops import attention_executed_fraction

    spec = model_preset("gpt-oss-120b")
    s, w, b, q = 8192, 128, 2, 64 * 64
    full_matrix = 4 * b * s * s * q
    assert layer_attention_forward_flops(spec, s, b) == pytest.approx(full_matrix * (18 * s + 18 * w) / (36 * s))
    executed = (18 * s * s / 2 + 18 * (w * s - w * (w - 1) / 2)) / (18 * s * s + 18 * w * s)
    assert attention_executed_fraction(spec, s, CAUSAL_EXECUTED_FRACTION) == pytest.approx(executed)
    # a window at least as long as the sequence is no window; a model without windows is untouched
    assert layer_attention_forward_flops(spec, w, b) == pytest.approx(4 * b * w * w * q)
    dense = model_preset("llama3-8b")
    assert attention_executed_fraction(dense, s, CAUSAL_EXECUTED_FRACTION) == CAUSAL_EXECUTED_FRACTION
