"""FP8 training in the cost model: the projections' GEMMs at the FP8 peak, cast traffic, FP8 weight copies and
FP8-saved activations, worked out by hand; and the BF16 -> FP8 change checked against a published pair of runs.

Published check: BAAI FlagPerf ran Megatron-Core 0.6 with Transformer Engine, Llama 3 8B, TP 2, micro-batch 1,
global batch 512 x 8,192, on 8 and 16 H100s, in BF16 and in FP8 (FlagOpen/FlagPerf
training/nvidia/llama3_8B-megatron/README.md, table "性能指标"): 8,103 -> 10,486 tokens/s per GPU (1.294x) on 8
GPUs and 7,914 -> 10,280 (1.299x) on 16, memory 71 -> 74 GiB and 62 -> 64 GiB (nvidia-smi, whole GiB).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from cost_models.compute import layer_time
from cost_models.efficiency import EfficiencyParams, SoftwareConfig, fitted_efficiency
from cost_models.hardware import GIB, GpuSpec, gpu_preset
from cost_models.iteration import estimate_iteration
from cost_models.layout import Hardware, ParallelShape, Workload
from cost_models.memory import layer_activation_bytes
from cost_models.model_spec import ModelSpec, model_preset
from cost_models.stage_costs import stage_cost_terms, stage_memory_bytes

GPU = GpuSpec("test-gpu", peak_tflops=100.0, memory_gib=80.0, hbm_bandwidth_gb_s=1000.0,
              intra_node_bandwidth_gb_s=200.0, inter_node_bandwidth_gb_s=25.0, peak_fp8_tflops=200.0)
EFF = EfficiencyParams(gemm_peak_fraction=0.5, gemm_half_width=64.0, hbm_fraction=0.5,
                       nvlink_fraction=0.75, network_fraction=0.8, layer_overhead_ms=0.1)
H, A, F = 1024, 16, 4096
MODEL = ModelSpec("gpt-small", 4, H, F, A, A, 32000, swiglu=False, tied_embeddings=False)
S, B = 512, 2
T = S * B
HBM = 1000e9 * 0.5  # achieved bytes/s


def eff(width: float) -> float:
    return 0.5 * width / (width + 64.0)


def test_fp8_runs_the_projections_at_the_fp8_peak_and_pays_their_casts():
    bf16 = layer_time(MODEL, S, B, 1, "none", GPU, 200.0, EFF, SoftwareConfig())
    fp8 = layer_time(MODEL, S, B, 1, "none", GPU, 200.0, EFF, SoftwareConfig(fp8=True))
    # tp 1: QKV 6Th^2, output 2Th^2, fc1 and fc2 8Th^2 each, all of width h
    gemm_bf16_s = 24 * T * H * H / (100e12 * eff(H))
    gemm_fp8_s = 24 * T * H * H / (200e12 * eff(H))
    # casts (read bf16, write fp8 and its transpose: 4 bytes per element): forward the four GEMM inputs
    # (h, h, h, f per token), backward the four output gradients (3h, h, f, h per token)
    cast_forward_s = T * (3 * H + F) * 4 / HBM
    cast_backward_s = T * (3 * H + H + F + H) * 4 / HBM
    assert fp8.forward_compute_ms - bf16.forward_compute_ms == pytest.approx(
        1e3 * (gemm_fp8_s - gemm_bf16_s + cast_forward_s), rel=1e-9)
    # backward: dX and dW GEMMs (twice the forward's) in FP8 too
    assert fp8.backward_compute_ms - bf16.backward_compute_ms == pytest.approx(
        1e3 * (2 * (gemm_fp8_s - gemm_bf16_s) + cast_backward_s), rel=1e-9)
    assert fp8.weight_grad_ms == pytest.approx(1e3 * gemm_fp8_s, rel=1e-9)


# A100 SXM's best measured BF16 matmul against its datasheet peak (ml-engineering's MAMF table, 271.2 of 312
# TFLOP/s), typed in: the built-in parameters are fitted on A100s, so GEMMs reach their fitted fraction of the
# datasheet peak scaled by a GPU's own measured fraction against this one.
A100_CEILING_FRACTION = 271.2 / 312


def test_a_measured_fp8_ceiling_prices_the_fp8_gemms_and_without_one_they_reach_bf16s_fraction():
    bf16_ceiling, fp8_ceiling = 80.0, 120.0  # of datasheet peaks 100 and 200
    measured = replace(GPU, matmul_ceiling_tflops=bf16_ceiling, fp8_matmul_ceiling_tflops=fp8_ceiling)
    bf16_only = replace(GPU, matmul_ceiling_tflops=bf16_ceiling)
    plain = layer_time(MODEL, S, B, 1, "none", GPU, 200.0, EFF, SoftwareConfig(fp8=True))
    gemm_plain_s = 24 * T * H * H / (200e12 * eff(H))
    for gpu, fp8_basis_tflops in ((measured, fp8_ceiling / A100_CEILING_FRACTION),
                                  (bf16_only, 200.0 * (bf16_ceiling / 100.0) / A100_CEILING_FRACTION)):
        fp8 = layer_time(MODEL, S, B, 1, "none", gpu, 200.0, EFF, SoftwareConfig(fp8=True))
        gemm_s = 24 * T * H * H / (fp8_basis_tflops * 1e12 * eff(H))
        # the attention core stays in BF16, at the BF16 ceiling
        attention_s = 0.5 * 4 * B * S**2 * H / (100e12 * eff(64))
        attention_measured_s = attention_s * 100.0 * A100_CEILING_FRACTION / bf16_ceiling
        assert fp8.forward_compute_ms - plain.forward_compute_ms == pytest.approx(
            1e3 * (gemm_s - gemm_plain_s + attention_measured_s - attention_s), rel=1e-9)
        assert fp8.weight_grad_ms == pytest.approx(1e3 * gemm_s, rel=1e-9)


def test_fp8_keeps_the_projection_inputs_in_one_byte():
    sbh = S * B * H
    for tp, sp in ((1, False), (4, True)):
        software = SoftwareConfig(sequence_parallel=sp)
        bf16 = layer_activation_bytes(MODEL, S, B, tp, "selective", software)
        fp8 = layer_activation_bytes(MODEL, S, B, tp, "selective", SoftwareConfig(sequence_parallel=sp, fp8=True))
        # two norm outputs (QKV and fc1 inputs) replicated unless SP; attention output and fc2 input TP-sharded
        saved = sbh * (2 / (tp if sp else 1) + (1 + F / H) / tp)
        assert bf16 - fp8 == pytest.approx(saved, rel=1e-12)


def test_fp8_weight_copies_add_two_bytes_per_layer_parameter():
    gpu = gpu_preset("H100-SXM")
    hardware = Hardware(gpu, 8, gpu.intra_node_bandwidth_gb_s, gpu.inter_node_bandwidth_gb_s)
    shape = ParallelShape(tp=2, pp=1, dp=4, micro_batch_size=1, recompute="full")
    workload = Workload(MODEL, S, 64, zero_stage=1)
    layers = MODEL.num_layers
    # full recompute stores only layer inputs (2 bytes, not FP8): the difference is the weight copies
    bf16 = stage_memory_bytes(stage_cost_terms(workload, hardware, shape, fitted_efficiency(), SoftwareConfig()), 0, layers)
    fp8 = stage_memory_bytes(stage_cost_terms(workload, hardware, shape, fitted_efficiency(), SoftwareConfig(fp8=True)),
                             0, layers)
    assert fp8 - bf16 == pytest.approx(2 * layers * MODEL.params_per_layer / 2, rel=1e-12)


def _flagperf(dp: int, fp8: bool) -> tuple[float, float]:
    """(iteration s, stage memory GiB) of FlagPerf's Llama 3 8B layout on dp x 2 H100s."""
    gpu = gpu_preset("H100-SXM")
    hardware = Hardware(gpu, 8, gpu.intra_node_bandwidth_gb_s, gpu.inter_node_bandwidth_gb_s)
    shape = ParallelShape(tp=2, pp=1, dp=dp, micro_batch_size=1, recompute="selective")
    terms = stage_cost_terms(Workload(model_preset("llama3-8b"), 8192, 512, zero_stage=1), hardware, shape,
                             fitted_efficiency(), SoftwareConfig(fp8=fp8))
    return estimate_iteration(terms, [32]).iteration_ms / 1e3, stage_memory_bytes(terms, 0, 32) / GIB


@pytest.mark.parametrize(("dp", "published_speedup", "published_extra_gib"), [(4, 10486 / 8103, 3), (8, 10280 / 7914, 2)])
def test_fp8_speedup_and_memory_match_flagperfs_published_pair(dp, published_speedup, published_extra_gib):
    (bf16_s, bf16_gib), (fp8_s, fp8_gib) = _flagperf(dp, False), _flagperf(dp, True)
    # The model prices FP8 GEMMs at the BF16 fit's fraction of their peak; real FP8 GEMMs reach a little less,
    # so the predicted speedup is 5% above the published one (1.36x against 1.29-1.30x).
    assert bf16_s / fp8_s == pytest.approx(published_speedup, rel=0.07)
    assert bf16_s / fp8_s > 1.2
    # nvidia-smi's whole GiB, with the caching allocator's slack: within a GiB
    assert fp8_gib - bf16_gib == pytest.approx(published_extra_gib, abs=1.0)
