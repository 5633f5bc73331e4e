"""Model state and activation memory (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", Table 2)."""

from __future__ import annotations

import pytest

from cost_models.efficiency import SoftwareConfig
from cost_models.memory import (
    embedding_activation_bytes,
    head_activation_bytes,
    in_flight_microbatches,
    layer_activation_bytes,
    state_bytes_per_param,
)
from cost_models.model_spec import ModelSpec

GIB = 1024**3

# Korthikanti's setting: unfused attention, dropout on.
NO_SP = SoftwareConfig(flash_attention=False, sequence_parallel=False, dropout=True)
SP = SoftwareConfig(flash_attention=False, sequence_parallel=True, dropout=True)


def gpt(hidden: int, heads: int, layers: int = 48) -> ModelSpec:
    return ModelSpec("gpt", layers, hidden, 4 * hidden, heads, heads, 51200, swiglu=False, tied_embeddings=True)


# (h, a, s, b, t): Korthikanti's 22B and 175B shapes plus a small one
SHAPES = [(6144, 64, 2048, 4, 8), (12288, 96, 2048, 1, 8), (1024, 16, 512, 2, 2), (2048, 16, 1024, 1, 1)]


@pytest.mark.parametrize("h,a,s,b,t", SHAPES)
def test_tp_without_sp(h, a, s, b, t):
    model = gpt(h, a)
    # Table 2, tensor parallel: s b h (10 + 24/t + 5 a s/(h t))
    expected = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert layer_activation_bytes(model, s, b, t, "none", NO_SP) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("h,a,s,b,t", SHAPES)
def test_tp_with_sp(h, a, s, b, t):
    model = gpt(h, a)
    # Table 2, tensor + sequence parallel: s b h/t (34 + 5 a s/h)
    expected = s * b * h / t * (34 + 5 * a * s / h)
    assert layer_activation_bytes(model, s, b, t, "none", SP) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("h,a,s,b,t", SHAPES)
def test_selective_recompute(h, a, s, b, t):
    model = gpt(h, a)
    # Table 2, TP + SP + selective: 34 s b h / t
    assert layer_activation_bytes(model, s, b, t, "selective", SP) == pytest.approx(34 * s * b * h / t, rel=1e-12)
    # Table 2, TP + selective (no SP): s b h (10 + 24/t)
    assert layer_activation_bytes(model, s, b, t, "selective", NO_SP) == pytest.approx(
        s * b * h * (10 + 24 / t), rel=1e-12
    )


@pytest.mark.parametrize("h,a,s,b,t", SHAPES)
def test_full_recompute(h, a, s, b, t):
    model = gpt(h, a)
    # only the layer input (2 bytes per element) is kept: 2 s b h, sharded by SP
    assert layer_activation_bytes(model, s, b, t, "full", SP) == pytest.approx(2 * s * b * h / t, rel=1e-12)
    assert layer_activation_bytes(model, s, b, t, "full", NO_SP) == pytest.approx(2 * s * b * h, rel=1e-12)


@pytest.mark.parametrize("h,a,s,b,t", SHAPES)
def test_flash_attention_removes_score_term(h, a, s, b, t):
    model = gpt(h, a)
    flash = SoftwareConfig(flash_attention=True, sequence_parallel=False, dropout=True)
    unfused = layer_activation_bytes(model, s, b, t, "none", NO_SP)
    fused = layer_activation_bytes(model, s, b, t, "none", flash)
    # softmax output (2), dropout mask (1) and dropout output (2) per score: 5 a s^2 b / t
    assert unfused - fused == pytest.approx(5 * a * s**2 * b / t, rel=1e-9)
    assert fused == pytest.approx(s * b * h * (10 + 24 / t), rel=1e-12)


def test_no_dropout_drops_the_masks():
    h, a, s, b, t = 4096, 32, 2048, 1, 4
    model = gpt(h, a)
    sw = SoftwareConfig(flash_attention=True, sequence_parallel=True, dropout=False)
    # 34 minus the two 1-byte hidden dropout masks = 32 s b h / t
    assert layer_activation_bytes(model, s, b, t, "none", sw) == pytest.approx(32 * s * b * h / t, rel=1e-12)


def test_korthikanti_22b_published_totals():
    # GPT 22B: h=6144, a=64, L=48, s=2048, b=4, t=8 (a model of Korthikanti et al. 2022)
    h, a, L, s, b, t = 6144, 64, 48, 2048, 4, 8
    model = gpt(h, a, layers=L)
    no_sp = L * layer_activation_bytes(model, s, b, t, "none", NO_SP) / GIB
    sp_selective = L * layer_activation_bytes(model, s, b, t, "selective", SP) / GIB
    assert no_sp == pytest.approx(59.25, rel=0.01)
    assert sp_selective == pytest.approx(9.56, rel=0.01)


@pytest.mark.parametrize("d", [1, 2, 8, 64])
def test_state_bytes_without_zero(d):
    # bf16 weights 2 + fp32 grads 4 + fp32 master/m/v 12 = 18, whatever d
    assert state_bytes_per_param(0, d) == 18.0


@pytest.mark.parametrize("d", [1, 2, 8, 64])
def test_state_bytes_zero1(d):
    # optimizer states sharded over d replicas: 6 + 12/d
    assert state_bytes_per_param(1, d) == pytest.approx(6 + 12 / d, rel=1e-12)


def test_head_and_embedding_activations():
    s, b, h, V, t = 2048, 2, 4096, 32000, 4
    model = ModelSpec("m", 4, h, 11008, 32, 32, V, swiglu=True, tied_embeddings=False)
    # fp32 logits, vocabulary split over t: 4 s b V / t
    assert head_activation_bytes(model, s, b, t) == pytest.approx(4 * s * b * V / t, rel=1e-12)
    # bf16 embedding output, sharded only with SP
    assert embedding_activation_bytes(model, s, b, t, True) == pytest.approx(2 * s * b * h / t, rel=1e-12)
    assert embedding_activation_bytes(model, s, b, t, False) == pytest.approx(2 * s * b * h, rel=1e-12)


@pytest.mark.parametrize("p,m", [(4, 8), (8, 8), (4, 2), (1, 16)])
def test_1f1b_in_flight(p, m):
    # 1F1B: stage i warms up p - i - 1 forwards and holds one more, at most m
    for i in range(p):
        assert in_flight_microbatches("1f1b", i, p, m, 1) == min(p - i, m)


def test_1f1b_in_flight_explicit():
    assert [in_flight_microbatches("1f1b", i, 4, 8, 1) for i in range(4)] == [4, 3, 2, 1]
    assert [in_flight_microbatches("1f1b", i, 4, 2, 1) for i in range(4)] == [2, 2, 2, 1]


@pytest.mark.parametrize("p,v", [(4, 2), (8, 4), (2, 3), (16, 2)])
def test_interleaved_first_stage_in_flight(p, v):
    m = 64  # enough microbatches that the warm-up is not capped
    # Korthikanti et al.: with interleaving the first stage holds p (1 + (p-1)/(p v)) layer sets
    expected = p * (1 + (p - 1) / (p * v))
    assert in_flight_microbatches("interleaved", 0, p, m, v) == pytest.approx(expected, rel=1e-12)


def test_interleaved_last_stage_in_flight():
    # Megatron warm-up for rank r: 2 (p - r - 1) + (v - 1) p chunks, plus the one in
    # progress, each chunk 1/v of the stage's layers. p = 4, v = 2, r = 3: (0 + 4 + 1)/2
    assert in_flight_microbatches("interleaved", 3, 4, 64, 2) == pytest.approx(2.5, rel=1e-12)


@pytest.mark.parametrize("m", [1, 8, 32])
def test_gpipe_holds_all_microbatches(m):
    for i in range(4):
        assert in_flight_microbatches("gpipe", i, 4, m, 1) == m
