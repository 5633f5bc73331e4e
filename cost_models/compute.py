"""Execution time of one transformer layer (and the embedding / head) on one TP group.

Time = GEMM FLOPs at an achieved efficiency that falls for narrow shards
+ attention core (fused flash kernel, or batched GEMMs plus softmax/dropout
traffic over HBM) + memory-bound elementwise traffic over HBM + a fixed
per-layer overhead. Tensor-parallel collectives are timed in `tp_comm`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from cost_models.choices import Recompute
from cost_models.comm import NVLINK_STEP_LATENCY_S, ring_all_reduce_s
from cost_models.context_parallel import BACKWARD_EXCHANGE_FACTOR, exchange_ms, exposed_exchange_ms, kv_exchange_bytes
from cost_models.efficiency import FLEX, EfficiencyParams, SoftwareConfig
from cost_models.fp8 import CAST_BYTES_PER_ELEMENT, cast_elements_per_token
from cost_models.flops import (
    BACKWARD_TO_FORWARD,
    attention_executed_fraction,
    layer_attention_forward_flops,
    layer_projection_gemms,
    mlp_projection_gemms,
)
from cost_models.hardware import FIT_REFERENCE_GPU, GpuSpec, gpu_preset
from cost_models.model_spec import ModelSpec

# A causal fused-attention kernel skips the upper triangle of the scores.
CAUSAL_EXECUTED_FRACTION = 0.5
# FlashAttention-2's backward recomputes the scores: 2.5x its forward FLOPs.
FLASH_BACKWARD_TO_FORWARD = 2.5
# FlashAttention-2's kernels on Hopper against the fused ones the model prices (cuDNN's, which FlashAttention-3
# matches): Shah et al., "FlashAttention-3" (2024), Figures 5-6, H100 80GB SXM5, head dim 128, 16k tokens:
# forward 335 against 539 TFLOP/s, backward 322 against 516 (2.5 times the forward's FLOPs). The time of a
# forward and its backward together, FA2 over cuDNN: 1.60.
FA2_ATTENTION_TIME_FACTOR = (1 / 335 + FLASH_BACKWARD_TO_FORWARD / 322) / (1 / 539 + FLASH_BACKWARD_TO_FORWARD / 516)
# Bytes per score element moved by unfused attention (write QK^T, softmax
# read+write, attention-probs read for scores x V) and by attention dropout
# (read, write, 1-byte mask).
SCORE_BYTES_NO_DROPOUT = 8.0
SCORE_BYTES_DROPOUT = 5.0
# Elementwise elements per token per layer, in units of h: two norms (read +
# write) and two residual adds (two reads, one write); dropout adds a read, a
# write of the fused kernel's mask.
NORM_RESIDUAL_ELEMENTS = 4.0 + 6.0
DROPOUT_ELEMENTS = 1.0
# Mixture of experts: each routed copy of a token is permuted to its expert and back, each a read and a write
# of h elements (Megatron's token dispatcher, `permute`/`unpermute`).
MOE_COPY_ELEMENTS = 4.0
BYTES_PER_ELEMENT = 2.0  # bf16 / fp16 activations


def gemm_efficiency(width: float, efficiency: EfficiencyParams) -> float:
    """Fraction of peak a GEMM reaches whose smaller non-token dimension is `width`."""
    return efficiency.gemm_peak_fraction * width / (width + efficiency.gemm_half_width)


@cache
def _reference_ceiling_fraction() -> float:
    reference = gpu_preset(FIT_REFERENCE_GPU)
    return reference.matmul_ceiling_tflops / reference.peak_tflops


def gemm_basis_tflops(gpu: GpuSpec, fp8: bool = False) -> float:
    """The TFLOP/s that `gemm_peak_fraction` is a fraction of on `gpu` (BF16, or FP8 GEMMs).

    The parameter is fitted on A100s, whose best measured matmul reaches 86.9% of the datasheet peak; newer
    GPUs reach less of theirs (H100 SXM 80.3% BF16 and 70.9% FP8, B200 77.6%: their datasheet peaks assume
    the boost clock, which 700-1,000 W do not sustain under dense tensor work). So a GPU's GEMMs run at the
    fitted fraction of its peak scaled by its measured ceiling against A100's (`gpus.json`,
    `matmul_ceiling_tflops`). Without a measured ceiling a GPU is taken to reach A100's fraction of its peak
    (BF16), and FP8 GEMMs the fraction of the FP8 peak that its BF16 GEMMs reach of theirs.
    """
    bf16_tflops = (gpu.peak_tflops if gpu.matmul_ceiling_tflops is None
                   else gpu.matmul_ceiling_tflops / _reference_ceiling_fraction())
    if not fp8 or gpu.peak_fp8_tflops is None:  # requests for FP8 on such a GPU are refused at the boundary
        return bf16_tflops
    if gpu.fp8_matmul_ceiling_tflops is None:
        return gpu.peak_fp8_tflops * bf16_tflops / gpu.peak_tflops
    return gpu.fp8_matmul_ceiling_tflops / _reference_ceiling_fraction()


def gemm_time_s(flops: float, width: float, gpu: GpuSpec, efficiency: EfficiencyParams, fp8: bool = False) -> float:
    """BF16 GEMMs, or FP8 ones (`gemm_basis_tflops`)."""
    return flops / (gemm_basis_tflops(gpu, fp8) * 1e12 * gemm_efficiency(width, efficiency))


def hbm_time_s(bytes_moved: float, gpu: GpuSpec, efficiency: EfficiencyParams) -> float:
    return bytes_moved / (gpu.hbm_bandwidth_gb_s * 1e9 * efficiency.hbm_fraction)


@dataclass(frozen=True)
class LayerTime:
    """One layer, one microbatch, one GPU of its TP group, at full speed (ms)."""

    forward_compute_ms: float
    backward_compute_ms: float
    forward_tp_comm_ms: float
    backward_tp_comm_ms: float
    # The part of backward_compute_ms that computes weight gradients: zero-bubble
    # schedules run it later, apart from the input gradient the previous stage waits for.
    weight_grad_ms: float = 0.0
    # ZeRO-2/3's per-microbatch data-parallel collectives, the part compute does not hide
    # (`cost_models.sharded_dp.with_sharded_comm`); like TP traffic, a slow GPU does not slow them.
    forward_shard_comm_ms: float = 0.0
    backward_shard_comm_ms: float = 0.0
    # Context parallelism's key/value exchange around the CP ring, the part attention does not hide
    # (`cost_models.context_parallel`).
    forward_cp_comm_ms: float = 0.0
    backward_cp_comm_ms: float = 0.0
    # Expert parallelism's all-to-all dispatch and combine of routed tokens, priced exposed
    # (`cost_models.expert_parallel`).
    forward_ep_comm_ms: float = 0.0
    backward_ep_comm_ms: float = 0.0

    @property
    def forward_ms(self) -> float:
        return self.forward_compute_ms + self.forward_comm_ms

    @property
    def backward_ms(self) -> float:
        return self.backward_compute_ms + self.backward_comm_ms

    @property
    def forward_comm_ms(self) -> float:
        """What a slow GPU does not slow down: TP, CP, EP and sharded data-parallel traffic."""
        return self.forward_tp_comm_ms + self.forward_shard_comm_ms + self.forward_cp_comm_ms + self.forward_ep_comm_ms

    @property
    def backward_comm_ms(self) -> float:
        return (self.backward_tp_comm_ms + self.backward_shard_comm_ms + self.backward_cp_comm_ms
                + self.backward_ep_comm_ms)


def _projection_gemms_s(
    model: ModelSpec, tokens: int, tp: int, gpu: GpuSpec, efficiency: EfficiencyParams, fp8: bool = False,
    expert_tp: int | None = None,
) -> float:
    """QKV, output projection, MLP (and router) GEMMs, each with its own shard width (`layer_projection_gemms`)."""
    return sum(gemm_time_s(flops, width, gpu, efficiency, fp8)
               for flops, width in layer_projection_gemms(model, tokens, tp, expert_tp))


def _attention_core_forward_s(
    model: ModelSpec,
    seq_length: int,
    micro_batch: int,
    tp: int,
    gpu: GpuSpec,
    efficiency: EfficiencyParams,
    software: SoftwareConfig,
    cp: int = 1,
) -> float:
    """One GPU's share: 1 / (tp cp) of the layer's attention (CP's causal chunks are load balanced)."""
    flops = layer_attention_forward_flops(model, seq_length, micro_batch) / (tp * cp)
    if software.flash_attention:
        executed = attention_executed_fraction(model, seq_length, CAUSAL_EXECUTED_FRACTION)
        kernel = FA2_ATTENTION_TIME_FACTOR if software.attention_kernel == "fa2" else 1.0
        return kernel * gemm_time_s(flops * executed, model.qk_head_width, gpu, efficiency) / efficiency.attention_fraction
    score_elements = model.num_attention_heads * seq_length * seq_length * micro_batch / (tp * cp)
    score_bytes = SCORE_BYTES_NO_DROPOUT + (SCORE_BYTES_DROPOUT if software.dropout else 0.0)
    return gemm_time_s(flops, model.qk_head_width, gpu, efficiency) + hbm_time_s(score_elements * score_bytes, gpu, efficiency)


def _activation_elements_per_token(model: ModelSpec) -> float:
    """The MLP's activation function (SwiGLU reads two inputs), in units of h elements per token."""
    return (3.0 if model.swiglu else 2.0) * model.mlp_width_per_token / model.hidden_size


def _elementwise_forward_s(
    model: ModelSpec, tokens: int, tp: int, gpu: GpuSpec, efficiency: EfficiencyParams, software: SoftwareConfig
) -> float:
    h = model.hidden_size
    replicated = NORM_RESIDUAL_ELEMENTS + (DROPOUT_ELEMENTS if software.dropout else 0.0)
    activation_fn = _activation_elements_per_token(model)
    # A mixture of experts copies each token to its experts and back (permute, unpermute).
    replicated += MOE_COPY_ELEMENTS * model.experts_per_token
    sp_divisor = tp if software.sequence_parallel else 1
    elements = tokens * h * (replicated / sp_divisor + activation_fn / tp)
    return hbm_time_s(elements * BYTES_PER_ELEMENT, gpu, efficiency)


def routed_experts_forward_ms(
    model: ModelSpec, tokens: float, tp: int, gpu: GpuSpec, efficiency: EfficiencyParams, software: SoftwareConfig,
    expert_tp: int | None = None,
) -> float:
    """A mixture of experts' routed experts' part of a layer's forward compute on one GPU, per mean layer: their
    GEMMs and the activation between them, what Megatron's EP overlap runs as the MLP node between the dispatch
    and the combine (`cost_models.expert_parallel.overlapped_all_to_all_ms`). Shared experts run with the
    attention before the dispatch (megatron/core/models/gpt/fine_grained_callables.py), and dense layers have
    no routed experts: both are left out, at their share of `mlp_width_per_token`."""
    if not model.is_moe:
        return 0.0
    routed_share = (model.expert_layers * model.experts_per_token * model.ffn_hidden_size
                    / (model.num_layers * model.mlp_width_per_token))
    gemms_s = sum(gemm_time_s(flops, width, gpu, efficiency, software.fp8)
                  for flops, width in mlp_projection_gemms(model, tokens, tp, expert_tp))
    activation_s = hbm_time_s(tokens * model.hidden_size * _activation_elements_per_token(model) / tp
                              * BYTES_PER_ELEMENT, gpu, efficiency)
    return 1e3 * routed_share * (gemms_s + activation_s)


def tp_all_reduce_ms(
    model: ModelSpec, tokens: int, tp: int, intra_bandwidth_gb_s: float, efficiency: EfficiencyParams
) -> float:
    """One all-reduce (or all-gather + reduce-scatter with SP) of the layer's activations."""
    bytes_total = tokens * model.hidden_size * BYTES_PER_ELEMENT
    bandwidth = intra_bandwidth_gb_s * efficiency.nvlink_fraction
    return 1e3 * ring_all_reduce_s(bytes_total, tp, bandwidth, NVLINK_STEP_LATENCY_S)


def mlp_tp_comm_ms(
    model: ModelSpec, tokens: float, tp: int, intra_bandwidth_gb_s: float, efficiency: EfficiencyParams,
    expert_tp: int | None = None, dispatcher: str = "alltoall", expert_intra_gb_s: float | None = None,
) -> tuple[float, float]:
    """(collectives Megatron can overlap with GEMMs, collectives it cannot) of one layer's MLP in one pass.

    A dense MLP (or a mixture of experts' dense first layers and its shared experts, TP linears like a
    dense MLP's) all-gathers and reduce-scatters the layer's tokens over TP. Routed experts with the all-to-all
    dispatcher instead gather, after the all-to-all, every routed copy their expert-TP group received and
    reduce-scatter the results (megatron/core/transformer/moe/token_dispatcher.py,
    `MoEAlltoAllTokenDispatcher.token_dispatch`/`token_combine` over `expt_tp`): a GPU's tokens / tp x top-k
    copies, times expert_tp over the group, k times the dense volume at expert-TP = TP and none at expert-TP 1,
    which is why MoE recipes set --expert-tensor-parallel-size 1. The flex dispatcher sends each copy to every
    expert-TP rank in its own exchange (`cost_models.expert_parallel`): nothing here. Per mean layer."""
    dense_ms = tp_all_reduce_ms(model, tokens, tp, intra_bandwidth_gb_s, efficiency)
    if not model.is_moe:
        return dense_ms, 0.0
    share = model.expert_layers / model.num_layers
    shared_ms = dense_ms if model.shared_expert_ffn_hidden_size else 0.0
    etp = tp if expert_tp is None else expert_tp
    routed_ms = 0.0
    if dispatcher != FLEX and etp > 1:
        copies = etp * tokens * model.experts_per_token / tp
        # Over the expert-TP group's own links (`expert_intra_gb_s`; default the TP group's: the same through
        # NVSwitch, fewer peer links on a direct mesh when etp < tp).
        routed_ms = tp_all_reduce_ms(model, copies, etp, expert_intra_gb_s or intra_bandwidth_gb_s, efficiency)
    return (1 - share) * dense_ms + share * shared_ms, share * routed_ms


def exposed_tp_comm_ms(comm_ms: float, gemm_ms: float, tp: int) -> float:
    """A TP collective overlapped with its GEMMs, as Megatron's --tp-comm-overlap runs it.

    The all-gather before a column-parallel GEMM and the reduce-scatter after a row-parallel one are
    split into tp chunks exchanged around the ring while the GEMM runs on the chunks already there
    (Wang et al., "Overlap Communication with Dependent Computation via Decomposition in Large Deep
    Learning Models", ASPLOS'23; Transformer Engine's userbuffers, used by Megatron-Core when
    --tp-comm-overlap is set). One chunk's transfer cannot hide (the first, or the last); the rest hides
    while the GEMMs last.
    """
    if tp <= 1 or comm_ms <= 0.0:
        return comm_ms
    return max(comm_ms - gemm_ms, comm_ms / tp)


def layer_time(
    model: ModelSpec,
    seq_length: int,
    micro_batch: int,
    tp: int,
    recompute: str,
    gpu: GpuSpec,
    intra_bandwidth_gb_s: float,
    efficiency: EfficiencyParams,
    software: SoftwareConfig,
    cp: int = 1,
    cp_link: tuple[float, float] = (0.0, 0.0),
    expert_tp: int | None = None,
    expert_intra_gb_s: float | None = None,
) -> LayerTime:
    """Forward and backward time of one layer for one microbatch (Megatron-style TP).

    Forward and backward each run two TP all-reduces (attention and MLP
    outputs). Full recompute repeats the whole forward, collectives included,
    inside the backward; selective recompute repeats the attention core.
    With context parallelism (`cp` > 1, its ring's `cp_link` (GB/s, step latency s) from
    `cost_models.context_parallel.ring_link`) one GPU sees seq_length / cp tokens and 1 / cp of the
    attention, and exchanges keys and values under it. A mixture of experts' routed experts are split over
    `expert_tp` ranks (default tp; `mlp_tp_comm_ms`), whose collectives run at `expert_intra_gb_s` (default
    `intra_bandwidth_gb_s`, the TP group's).
    """
    tokens = seq_length * micro_batch / cp
    gemm_s = _projection_gemms_s(model, tokens, tp, gpu, efficiency, software.fp8, expert_tp)
    attention_s = _attention_core_forward_s(model, seq_length, micro_batch, tp, gpu, efficiency, software, cp)
    elementwise_s = _elementwise_forward_s(model, tokens, tp, gpu, efficiency, software)
    cast_forward_s = cast_backward_s = 0.0
    if software.fp8:
        forward_elements, backward_elements = cast_elements_per_token(model, tp, software.sequence_parallel)
        cast_forward_s = hbm_time_s(tokens * forward_elements * CAST_BYTES_PER_ELEMENT, gpu, efficiency)
        cast_backward_s = hbm_time_s(tokens * backward_elements * CAST_BYTES_PER_ELEMENT, gpu, efficiency)
    overhead_s = efficiency.layer_overhead_ms / 1e3
    attention_backward_ratio = FLASH_BACKWARD_TO_FORWARD if software.flash_attention else BACKWARD_TO_FORWARD

    forward_compute_s = gemm_s + attention_s + elementwise_s + overhead_s + cast_forward_s
    backward_compute_s = (
        BACKWARD_TO_FORWARD * (gemm_s + elementwise_s + overhead_s) + attention_backward_ratio * attention_s
        + cast_backward_s
    )
    mlp_ms, dispatched_ms = mlp_tp_comm_ms(model, tokens, tp, intra_bandwidth_gb_s, efficiency, expert_tp,
                                           software.moe_dispatcher, expert_intra_gb_s)
    comm_ms = backward_comm_ms = tp_all_reduce_ms(model, tokens, tp, intra_bandwidth_gb_s, efficiency) + mlp_ms
    if software.tp_comm_overlap or software.async_tp:
        # The forward's collectives overlap its GEMMs; the dispatcher's do not.
        comm_ms = exposed_tp_comm_ms(comm_ms, 1e3 * gemm_s, tp)
    if software.tp_comm_overlap:
        # The backward's overlap its dX GEMMs, of the forward's size (asynchronous TP leaves them exposed).
        backward_comm_ms = comm_ms
    recompute_comm_ms = backward_comm_ms + dispatched_ms  # a full recompute's forward runs inside the backward
    comm_ms += dispatched_ms
    backward_comm_ms += dispatched_ms
    kv_bytes = kv_exchange_bytes(model, seq_length, micro_batch, tp, cp)
    forward_cp_ms = exposed_exchange_ms(exchange_ms(kv_bytes, cp, *cp_link), 1e3 * attention_s, cp)
    backward_cp_ms = exposed_exchange_ms(
        exchange_ms(BACKWARD_EXCHANGE_FACTOR * kv_bytes, cp, *cp_link), 1e3 * attention_backward_ratio * attention_s, cp)
    if recompute == Recompute.FULL:
        backward_compute_s += forward_compute_s
        backward_comm_ms += recompute_comm_ms
        backward_cp_ms += forward_cp_ms
    elif recompute == Recompute.SELECTIVE:
        backward_compute_s += attention_s
        backward_cp_ms += forward_cp_ms  # the recomputed attention gathers the keys and values again
    return LayerTime(
        forward_compute_ms=1e3 * forward_compute_s,
        backward_compute_ms=1e3 * backward_compute_s,
        forward_tp_comm_ms=comm_ms,
        backward_tp_comm_ms=backward_comm_ms,
        # Each projection's backward is two GEMMs of its forward's size: dX and dW.
        weight_grad_ms=1e3 * gemm_s,
        forward_cp_comm_ms=forward_cp_ms,
        backward_cp_comm_ms=backward_cp_ms,
    )


def head_time(
    model: ModelSpec,
    seq_length: int,
    micro_batch: int,
    tp: int,
    gpu: GpuSpec,
    efficiency: EfficiencyParams,
) -> LayerTime:
    """Final norm, vocabulary projection and cross-entropy on the last stage.

    The loss reads bf16 logits, writes and re-reads them in fp32 (12 bytes per
    logit forward, twice that backward).
    """
    tokens = seq_length * micro_batch
    vocab_shard = model.vocab_size / tp
    gemm_s = gemm_time_s(2 * tokens * model.hidden_size * vocab_shard, min(model.hidden_size, vocab_shard), gpu, efficiency)
    loss_s = hbm_time_s(12.0 * tokens * vocab_shard, gpu, efficiency)
    norm_s = hbm_time_s(4.0 * tokens * model.hidden_size, gpu, efficiency)
    forward_s = gemm_s + loss_s + norm_s
    return LayerTime(
        forward_compute_ms=1e3 * forward_s,
        backward_compute_ms=1e3 * BACKWARD_TO_FORWARD * forward_s,
        forward_tp_comm_ms=0.0,
        backward_tp_comm_ms=0.0,
        weight_grad_ms=1e3 * gemm_s,
    )


def embedding_time(
    model: ModelSpec,
    seq_length: int,
    micro_batch: int,
    tp: int,
    gpu: GpuSpec,
    intra_bandwidth_gb_s: float,
    efficiency: EfficiencyParams,
) -> LayerTime:
    """Vocabulary-parallel embedding lookup: a write of s b h and one TP all-reduce."""
    tokens = seq_length * micro_batch
    lookup_s = hbm_time_s(2.0 * tokens * model.hidden_size, gpu, efficiency)
    comm_ms = tp_all_reduce_ms(model, tokens, tp, intra_bandwidth_gb_s, efficiency)
    return LayerTime(
        forward_compute_ms=1e3 * lookup_s,
        backward_compute_ms=1e3 * BACKWARD_TO_FORWARD * lookup_s,
        forward_tp_comm_ms=comm_ms,
        backward_tp_comm_ms=0.0,
        # Token ids need no gradient: the embedding's whole backward is its weight gradient.
        weight_grad_ms=1e3 * BACKWARD_TO_FORWARD * lookup_s,
    )
