"""Layer execution time: GEMMs at a width-dependent efficiency, attention core,
HBM-bound elementwise traffic, fixed overhead, and Megatron TP all-reduces.

All expected times are written out from a round-number GPU and efficiency set.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from cost_models.comm import NVLINK_STEP_LATENCY_S
from cost_models.compute import (
    embedding_time,
    gemm_efficiency,
    head_time,
    layer_time,
    tp_all_reduce_ms,
)
from cost_models.efficiency import EfficiencyParams, SoftwareConfig
from cost_models.hardware import GpuSpec
from cost_models.model_spec import ModelSpec

GPU = GpuSpec("test-gpu", peak_tflops=100.0, memory_gib=80.0, hbm_bandwidth_gb_s=1000.0,
              intra_node_bandwidth_gb_s=200.0, inter_node_bandwidth_gb_s=25.0)
EFF = EfficiencyParams(gemm_peak_fraction=0.5, gemm_half_width=64.0, hbm_fraction=0.5,
                       nvlink_fraction=0.75, network_fraction=0.8, layer_overhead_ms=0.1)
PEAK = 100e12  # FLOP/s
HBM = 1000e9 * 0.5  # achieved bytes/s
NVLINK = 200.0 * 0.75  # achieved GB/s

FLASH = SoftwareConfig(flash_attention=True, sequence_parallel=False, dropout=False)
FLASH_SP = SoftwareConfig(flash_attention=True, sequence_parallel=True, dropout=False)
UNFUSED = SoftwareConfig(flash_attention=False, sequence_parallel=False, dropout=True)

# GPT shape: h = 1024, 16 heads of 64, ffn 4h
H, A, V = 1024, 16, 32000
MODEL = ModelSpec("gpt-small", 4, H, 4 * H, A, A, V, swiglu=False, tied_embeddings=False)
S, B = 512, 2
T = S * B  # tokens


def eff(width: float) -> float:
    return 0.5 * width / (width + 64.0)


def run(tp: int, recompute: str, software: SoftwareConfig):
    return layer_time(MODEL, S, B, tp, recompute, GPU, 200.0, EFF, software)


@pytest.mark.parametrize("width,expected", [(64.0, 0.25), (192.0, 0.375), (0.0, 0.0), (4096.0, 0.5 * 4096 / 4160)])
def test_gemm_efficiency_formula(width, expected):
    # peak_fraction * w / (w + half_width): half of the peak fraction at w = half_width
    assert gemm_efficiency(width, EFF) == pytest.approx(expected, rel=1e-12)


def test_gemm_efficiency_default_params():
    params = EfficiencyParams()
    w = 1000.0
    assert gemm_efficiency(w, params) == pytest.approx(
        params.gemm_peak_fraction * w / (w + params.gemm_half_width), rel=1e-12
    )


def test_forward_compute_tp1_by_hand():
    # GEMMs: QKV 6Th^2, out 2Th^2, fc1 8Th^2, fc2 8Th^2, all of width h
    gemm_s = 24 * T * H**2 / (PEAK * eff(H))
    # causal flash kernel executes half of 4 b s^2 h at head-dim width 64
    attn_s = 0.5 * 4 * B * S**2 * H / (PEAK * eff(64))
    # two norms + two residuals (10 h per token) + GELU in/out (2 * 4h), bf16
    elem_s = T * H * (10 + 2 * 4) * 2 / HBM
    overhead_s = 0.1e-3
    lt = run(1, "none", FLASH)
    assert lt.forward_compute_ms == pytest.approx(1e3 * (gemm_s + attn_s + elem_s + overhead_s), rel=1e-12)
    # backward: 2x for GEMMs, elementwise and overhead; FlashAttention-2 backward 2.5x its forward
    assert lt.backward_compute_ms == pytest.approx(
        1e3 * (2 * (gemm_s + elem_s + overhead_s) + 2.5 * attn_s), rel=1e-12
    )
    assert lt.forward_tp_comm_ms == 0.0
    assert lt.backward_tp_comm_ms == 0.0


def test_forward_compute_tp4_narrow_shards_by_hand():
    tp = 4
    gemm_s = (
        2 * T * H * (3 * H / tp) / (PEAK * eff(3 * H / tp))  # QKV: N = 3h/t = 768
        + 2 * T * (H / tp) * H / (PEAK * eff(H / tp))  # out: K = h/t = 256
        + 2 * T * H * (4 * H / tp) / (PEAK * eff(H))  # fc1: N = 4h/t = 1024 = h
        + 2 * T * (4 * H / tp) * H / (PEAK * eff(H))  # fc2: K = 4h/t = 1024 = h
    )
    attn_s = 0.5 * 4 * B * S**2 * H / tp / (PEAK * eff(64))
    # SP shards the norms/residuals; the activation function is TP-sharded
    elem_s = T * H * (10 / tp + 8 / tp) * 2 / HBM
    lt = run(tp, "none", FLASH_SP)
    assert lt.forward_compute_ms == pytest.approx(1e3 * (gemm_s + attn_s + elem_s + 0.1e-3), rel=1e-12)


def test_unfused_attention_by_hand_and_backward_is_twice_forward():
    tp = 2
    lt = run(tp, "none", UNFUSED)
    # unfused: full 4 b s^2 h / t at width 64, plus score traffic a s^2 b / t elements
    # of 8 bytes (QK^T write, softmax r/w, probs read) + 5 bytes of dropout
    attn_s = 4 * B * S**2 * H / tp / (PEAK * eff(64)) + A * S**2 * B / tp * (8 + 5) / HBM
    gemm_s = (
        2 * T * H * (3 * H / tp) / (PEAK * eff(H))  # N = 1536 -> width h
        + 2 * T * (H / tp) * H / (PEAK * eff(H / tp))  # K = 512
        + 2 * T * H * (4 * H / tp) / (PEAK * eff(H))
        + 2 * T * (4 * H / tp) * H / (PEAK * eff(H))
    )
    # dropout adds 1 h per token to the replicated elementwise traffic (no SP)
    elem_s = T * H * (11 + 8 / tp) * 2 / HBM
    assert lt.forward_compute_ms == pytest.approx(1e3 * (gemm_s + attn_s + elem_s + 0.1e-3), rel=1e-12)
    # without flash attention every part's backward is 2x its forward
    assert lt.backward_compute_ms == pytest.approx(2 * lt.forward_compute_ms, rel=1e-12)
    assert lt.backward_tp_comm_ms == pytest.approx(lt.forward_tp_comm_ms, rel=1e-12)


def test_flash_attention_2_on_hopper_slows_the_attention_core_alone_by_the_papers_ratio():
    """FlashAttention-2's kernels (`attention_kernel` fa2) cost the attention core, forward and backward, the
    FlashAttention-3 paper's H100 ratio to cuDNN's (head dim 128, 16k tokens: forward 335 against 539 TFLOP/s,
    backward 322 against 516 on 2.5x the FLOPs); GEMMs, elementwise traffic and overhead stay as they were."""
    ratio = (1 / 335 + 2.5 / 322) / (1 / 539 + 2.5 / 516)
    assert 1.59 < ratio < 1.61
    fa2 = SoftwareConfig(flash_attention=True, sequence_parallel=False, dropout=False, attention_kernel="fa2")
    attn_s = 0.5 * 4 * B * S**2 * H / (PEAK * eff(64))
    fused, slow = run(1, "none", FLASH), run(1, "none", fa2)
    assert slow.forward_compute_ms - fused.forward_compute_ms == pytest.approx(1e3 * (ratio - 1) * attn_s, rel=1e-9)
    assert slow.backward_compute_ms - fused.backward_compute_ms == pytest.approx(
        1e3 * (ratio - 1) * 2.5 * attn_s, rel=1e-9)
    # unfused attention (flash_attention off) runs no FlashAttention kernel: the setting changes nothing
    unfused_fa2 = SoftwareConfig(flash_attention=False, sequence_parallel=False, dropout=True, attention_kernel="fa2")
    assert run(2, "none", unfused_fa2) == run(2, "none", UNFUSED)


def test_attention_fraction_divides_the_fused_attention_core_alone():
    """A stack whose attention reaches half the modelled kernel speed (`attention_fraction` 0.5) pays the fused
    attention core twice, forward and backward (2.5x its forward), and nothing else; unfused attention, the
    2021-22 runs' and not a fused kernel, is untouched."""
    attn_s = 0.5 * 4 * B * S**2 * H / (PEAK * eff(64))
    half = replace(EFF, attention_fraction=0.5)
    fused = run(1, "none", FLASH)
    slow = layer_time(MODEL, S, B, 1, "none", GPU, 200.0, half, FLASH)
    assert slow.forward_compute_ms - fused.forward_compute_ms == pytest.approx(1e3 * attn_s, rel=1e-9)
    assert slow.backward_compute_ms - fused.backward_compute_ms == pytest.approx(1e3 * 2.5 * attn_s, rel=1e-9)
    assert slow.forward_tp_comm_ms == fused.forward_tp_comm_ms
    assert layer_time(MODEL, S, B, 2, "none", GPU, 200.0, half, UNFUSED) == run(2, "none", UNFUSED)


# A100 SXM's best measured BF16 matmul against its datasheet peak (ml-engineering's MAMF table, 271.2 of 312
# TFLOP/s), typed in: the parameters are fitted on A100s.
A100_CEILING_FRACTION = 271.2 / 312


def test_a_measured_matmul_ceiling_scales_gemms_and_attention_against_a100s_and_nothing_else():
    """A GPU whose best matmul reaches 60% of its peak runs every GEMM (and the fused attention kernel) at the
    fitted fraction of 60 / 0.869 TFLOP/s; elementwise traffic and overhead keep their times."""
    measured = replace(GPU, matmul_ceiling_tflops=60.0)
    basis = 60e12 / A100_CEILING_FRACTION
    gemm_s = 24 * T * H**2 / (basis * eff(H))
    attn_s = 0.5 * 4 * B * S**2 * H / (basis * eff(64))
    elem_s = T * H * (10 + 2 * 4) * 2 / HBM
    lt = layer_time(MODEL, S, B, 1, "none", measured, 200.0, EFF, FLASH)
    assert lt.forward_compute_ms == pytest.approx(1e3 * (gemm_s + attn_s + elem_s + 0.1e-3), rel=1e-12)
    assert lt.backward_compute_ms == pytest.approx(1e3 * (2 * (gemm_s + elem_s + 0.1e-3) + 2.5 * attn_s), rel=1e-12)
    # the head's GEMM too; a GPU at exactly A100's fraction prices as its datasheet peak says (what a GPU
    # without a measured ceiling gets)
    assert head_time(MODEL, S, B, 2, measured, EFF).forward_compute_ms > head_time(MODEL, S, B, 2, GPU,
                                                                                   EFF).forward_compute_ms
    at_a100s = replace(GPU, matmul_ceiling_tflops=100.0 * A100_CEILING_FRACTION)
    reference, same = run(2, "full", FLASH_SP), layer_time(MODEL, S, B, 2, "full", at_a100s, 200.0, EFF, FLASH_SP)
    assert same.forward_compute_ms == pytest.approx(reference.forward_compute_ms, rel=1e-12)
    assert same.backward_compute_ms == pytest.approx(reference.backward_compute_ms, rel=1e-12)


@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("software", [FLASH, FLASH_SP, UNFUSED])
def test_full_recompute_adds_one_forward(tp, software):
    none = run(tp, "none", software)
    full = run(tp, "full", software)
    assert full.forward_compute_ms == pytest.approx(none.forward_compute_ms, rel=1e-12)
    assert full.forward_tp_comm_ms == pytest.approx(none.forward_tp_comm_ms, rel=1e-12)
    # the backward repeats the whole forward: compute and both TP all-reduces
    assert full.backward_compute_ms == pytest.approx(none.backward_compute_ms + none.forward_compute_ms, rel=1e-12)
    assert full.backward_tp_comm_ms == pytest.approx(none.backward_tp_comm_ms + none.forward_tp_comm_ms, rel=1e-12)


@pytest.mark.parametrize("tp", [1, 4])
def test_selective_recompute_adds_attention_core(tp):
    none = run(tp, "none", FLASH)
    selective = run(tp, "selective", FLASH)
    attn_s = 0.5 * 4 * B * S**2 * H / tp / (PEAK * eff(64))
    assert selective.backward_compute_ms - none.backward_compute_ms == pytest.approx(1e3 * attn_s, rel=1e-9)
    assert selective.backward_tp_comm_ms == pytest.approx(none.backward_tp_comm_ms, rel=1e-12)
    assert selective.forward_ms == pytest.approx(none.forward_ms, rel=1e-12)


def test_tp_comm_zero_at_tp1():
    lt = run(1, "full", FLASH)
    assert lt.forward_tp_comm_ms == 0.0 and lt.backward_tp_comm_ms == 0.0
    assert tp_all_reduce_ms(MODEL, T, 1, 200.0, EFF) == 0.0


def test_tp8_comm_is_two_ring_all_reduces_over_nvlink():
    tp = 8
    nbytes = S * B * H * 2  # bf16 activations of the microbatch
    # ring all-reduce: 2 (n-1)/n * bytes / bw + 2 (n-1) NVLink hops
    one_all_reduce_s = 2 * 7 / 8 * nbytes / (NVLINK * 1e9) + 14 * NVLINK_STEP_LATENCY_S
    lt = run(tp, "none", FLASH)
    # attention output and MLP output, forward; the same two in the backward
    assert lt.forward_tp_comm_ms == pytest.approx(2 * 1e3 * one_all_reduce_s, rel=1e-12)
    assert lt.backward_tp_comm_ms == pytest.approx(2 * 1e3 * one_all_reduce_s, rel=1e-12)
    # numbers: 2 MiB-ish buffer, 1.75 * 2097152 / 150e9 s = 24.47 us, plus 42 us latency
    assert 1e3 * one_all_reduce_s == pytest.approx(1e3 * (1.75 * 2097152 / 150e9 + 42e-6), rel=1e-12)


def test_overlapped_tp_comm_hides_behind_the_gemms_but_one_chunk():
    tp = 8
    nbytes = S * B * H * 2
    comm_ms = 2 * 1e3 * (2 * 7 / 8 * nbytes / (NVLINK * 1e9) + 14 * NVLINK_STEP_LATENCY_S)
    # Projection GEMMs of one layer's forward, split over tp, each at the efficiency of its shard width:
    # QKV 6Th^2 (width 3h/8), output 2Th^2 (h/8), fc1 and fc2 8Th^2 each (4h/8).
    gemm_ms = 1e3 * T * H * H / tp / PEAK * (6 / eff(3 * H / 8) + 2 / eff(H / 8) + 16 / eff(4 * H / 8))
    overlapped = run(tp, "none", SoftwareConfig(flash_attention=True, tp_comm_overlap=True))
    plain = run(tp, "none", SoftwareConfig(flash_attention=True))
    expected = max(comm_ms - gemm_ms, comm_ms / tp)
    assert overlapped.forward_tp_comm_ms == pytest.approx(expected, rel=1e-9)
    assert overlapped.backward_tp_comm_ms == pytest.approx(expected, rel=1e-9)
    assert overlapped.forward_tp_comm_ms < plain.forward_tp_comm_ms
    assert overlapped.forward_compute_ms == plain.forward_compute_ms  # the GEMMs themselves take as long
    # Nothing to overlap without tensor parallelism.
    assert run(1, "none", SoftwareConfig(tp_comm_overlap=True)).forward_tp_comm_ms == 0.0


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_async_tp_hides_the_forward_collectives_only(recompute):
    # PyTorch's asynchronous TP overlaps the forward's collectives with their GEMMs, as Megatron's overlap does;
    # the backward's, and a full recompute's forward (run inside the backward), stay exposed.
    tp = 8
    nbytes = S * B * H * 2
    comm_ms = 2 * 1e3 * (2 * 7 / 8 * nbytes / (NVLINK * 1e9) + 14 * NVLINK_STEP_LATENCY_S)
    gemm_ms = 1e3 * T * H * H / tp / PEAK * (6 / eff(3 * H / 8) + 2 / eff(H / 8) + 16 / eff(4 * H / 8))
    hidden = max(comm_ms - gemm_ms, comm_ms / tp)
    recomputed_ms = comm_ms if recompute == "full" else 0.0
    asynchronous = run(tp, recompute, SoftwareConfig(flash_attention=True, async_tp=True))
    assert asynchronous.forward_tp_comm_ms == pytest.approx(hidden, rel=1e-9)
    assert asynchronous.backward_tp_comm_ms == pytest.approx(comm_ms + recomputed_ms, rel=1e-9)
    # Megatron's overlap, set as well, hides the backward's too.
    both = run(tp, recompute, SoftwareConfig(flash_attention=True, async_tp=True, tp_comm_overlap=True))
    assert both.backward_tp_comm_ms == pytest.approx(hidden + (hidden if recompute == "full" else 0.0), rel=1e-9)
    plain = run(tp, recompute, SoftwareConfig(flash_attention=True))
    assert asynchronous.backward_compute_ms == plain.backward_compute_ms


def test_head_time_by_hand():
    tp = 2
    shard = V / tp
    gemm_s = 2 * T * H * shard / (PEAK * eff(H))  # width min(h, V/t) = h
    loss_s = 12 * T * shard / HBM  # bf16 read, fp32 write + re-read
    norm_s = 4 * T * H / HBM  # final norm read + write, bf16
    ht = head_time(MODEL, S, B, tp, GPU, EFF)
    assert ht.forward_compute_ms == pytest.approx(1e3 * (gemm_s + loss_s + norm_s), rel=1e-12)
    assert ht.backward_compute_ms == pytest.approx(2e3 * (gemm_s + loss_s + norm_s), rel=1e-12)


def test_embedding_time_by_hand():
    tp = 4
    et = embedding_time(MODEL, S, B, tp, GPU, 200.0, EFF)
    lookup_s = 2 * T * H / HBM
    one_all_reduce_s = 2 * 3 / 4 * (T * H * 2) / (NVLINK * 1e9) + 6 * NVLINK_STEP_LATENCY_S
    assert et.forward_compute_ms == pytest.approx(1e3 * lookup_s, rel=1e-12)
    assert et.backward_compute_ms == pytest.approx(2e3 * lookup_s, rel=1e-12)
    assert et.forward_tp_comm_ms == pytest.approx(1e3 * one_all_reduce_s, rel=1e-12)
    assert et.backward_tp_comm_ms == 0.0
