"""The physical efficiencies (four fitted, two measured, two fitted for Hopper), and the software settings that
are not fitted.

Four numbers are fitted to ../shared/calibration (see benchmarks/fidelity.py); the two link efficiencies
are NCCL's published measurements (`MEASURED_EFFICIENCY`), which those runs cannot pin down; attention's speed
and FSDP's overlap, which those runs cannot see, are fitted to published H100/H200 runs (`HOPPER_FITTED`);
everything else in the cost model is counted from first principles: FLOPs, bytes moved over HBM, NVLink and
the network, and activation bytes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from functools import cache
from importlib import resources


@dataclass(frozen=True)
class EfficiencyParams:
    """Achieved fractions of hardware peaks.

    gemm_peak_fraction: fraction of peak FLOP/s a wide GEMM reaches on the A100s the built-in
        parameters are fitted on; a GPU's GEMMs reach it scaled by its measured matmul ceiling
        against A100's (`cost_models.compute.gemm_basis_tflops`).
    gemm_half_width: GEMM width (elements, the smaller of N and K per GPU)
        at which a GEMM reaches half of gemm_peak_fraction; narrow TP shards
        run less efficiently.
    hbm_fraction: fraction of HBM bandwidth memory-bound kernels (norms,
        activations, dropout, softmax) reach.
    nvlink_fraction: fraction of NVLink bandwidth NCCL collectives reach.
    network_fraction: fraction of per-GPU network bandwidth collectives and
        point-to-point transfers reach.
    layer_overhead_ms: fixed host and launch time per layer per microbatch
        forward (backward pays it twice).
    attention_fraction: fraction of the modelled fused-attention throughput (the kernels
        `SoftwareConfig.attention_kernel` names, at their published speed) a stack's attention
        reaches. 1 in the A100 fit, whose runs ran unfused attention, which this does not touch;
        GPUs with FP8 tensor cores (Hopper or newer) take the value fitted to half of the published
        2023+ H100/H200 runs (`cost_models.gpu_efficiency`); a user's calibration fits their own.
    shard_overlap_fraction: fraction of ZeRO-3/FSDP's per-layer collectives (and ZeRO-2's reduce-scatters)
        that can run under the layer's compute; the rest runs exposed (`cost_models.sharded_dp.with_sharded_comm`).
        1 in the A100 fit, as the frameworks are designed to run (prefetch one layer ahead); on GPUs with FP8
        tensor cores Hopper's fitted value (`cost_models.gpu_efficiency`), about a third. A
        stack whose prefetches are issued late (a host that does not run ahead of the GPU: per-microbatch host
        syncs, CPU-bound dispatch) or whose collectives slow the compute they share SMs and HBM with hides
        less, which a user's calibration measures.
    """

    gemm_peak_fraction: float = 0.80
    gemm_half_width: float = 64.0
    hbm_fraction: float = 0.70
    nvlink_fraction: float = 0.75
    network_fraction: float = 0.80
    layer_overhead_ms: float = 0.05
    attention_fraction: float = 1.0
    shard_overlap_fraction: float = 1.0

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


# Physically plausible ranges of each parameter: what A100/H100 GEMM, STREAM-like copy and NCCL
# bus-bandwidth measurements reach. A fit that wants to leave them is absorbing a missing effect,
# not measuring an efficiency, so fits stop at them (and say so).
EFFICIENCY_BOUNDS: dict[str, tuple[float, float]] = {
    "gemm_peak_fraction": (0.6, 0.9),
    "gemm_half_width": (8.0, 512.0),
    "hbm_fraction": (0.5, 0.92),
    "nvlink_fraction": (0.5, 0.9),
    "network_fraction": (0.5, 0.98),
    "layer_overhead_ms": (0.005, 0.3),
    # Not fitted to the A100 runs, which price no fused attention: held at the kernels' published speed.
    "attention_fraction": (1.0, 1.0),
    # Not fitted either: the A100 runs shard nothing per layer (ZeRO-1 at most).
    "shard_overlap_fraction": (1.0, 1.0),
}

# The link efficiencies, as NCCL's maintainers published them, held at these values by the built-in fit
# (`benchmarks/fidelity.py --fit`): SC'21's and Korthikanti's errors move by less than 0.3 points over
# network_fraction 0.5-0.98 (`benchmarks.fidelity --profile network_fraction`), and the fit, all but indifferent,
# had drifted to the range's lower bound; measured, it is not a guess. NVLink's the runs do pin down, where the
# measurement is. A user's calibration still fits both to their own runs.
MEASURED_EFFICIENCY: dict[str, float] = {
    # The network: on DGX A100 (8 x 200 Gb/s HDR InfiniBand, 25 GB/s per GPU) "we measure 192GB/s AllReduce
    # BusBW" (NVIDIA/nccl#812, quoted in #1576), 0.96 of line rate; ConnectX-7 at NDR 400 Gb/s "should achieve
    # up to 48-49GB/s per NIC" (NVIDIA/nccl-tests#267), 0.96-0.98 of 50 GB/s.
    "network_fraction": 0.96,
    # NVLink: "450GB/s is the line rate. With the protocol overhead (~20%) NCCL can get an effective NVLink
    # bandwidth of 370GB/s" on H100 (NVIDIA/nccl-tests#212): 0.82, what the A100 runs' fit found too (0.821).
    "nvlink_fraction": 0.82,
}


# Wider ranges for a user's calibration (POST /v1/calibrations): their stack may be much slower than the
# published runs (an older framework, a slow host, congested links) and the fit must be able to say so;
# beyond these a parameter no longer reads as an efficiency.
CALIBRATION_BOUNDS: dict[str, tuple[float, float]] = {
    "gemm_peak_fraction": (0.2, 0.95),
    "gemm_half_width": (4.0, 2048.0),
    "hbm_fraction": (0.2, 0.95),
    "nvlink_fraction": (0.2, 0.95),
    "network_fraction": (0.1, 0.95),
    "layer_overhead_ms": (0.001, 5.0),
    "attention_fraction": (0.2, 1.2),
    # Down to nearly none of the per-layer collectives hidden; never more than all of them.
    "shard_overlap_fraction": (0.02, 1.0),
}
# Bounds that are a parameter's design rather than the edge of plausibility: a fit that ends on one has found the
# stack working as designed (all of its per-layer collectives hidden), not an effect the model misses.
DESIGN_BOUNDS: dict[str, float] = {"shard_overlap_fraction": 1.0}


@cache
def _fitted_file() -> dict:
    path = resources.files(__package__).joinpath("presets/fitted_efficiency.json")
    return json.loads(path.read_text()) if path.is_file() else {}


@cache
def fitted_efficiency() -> EfficiencyParams:
    """The parameters last fitted by `benchmarks/fidelity.py --fit`, the measured ones among them (package data):
    the A100 fit, which every GPU shares but for Hopper's `HOPPER_FITTED` (`cost_models.gpu_efficiency`)."""
    values = _fitted_file().get("params")
    if values is None:
        return EfficiencyParams()
    return EfficiencyParams(**{name: float(values[name]) for name in EfficiencyParams.field_names() if name in values})


# What the published 2023+ H100/H200 runs are fitted for (`benchmarks.fidelity --fit`), taken by GPUs with FP8
# tensor cores in place of the A100 fit's values (`cost_models.gpu_efficiency`): the A100 runs ran unfused
# attention and sharded nothing per layer, so they cannot say how fast fused attention runs or how much of
# FSDP's traffic hides.
HOPPER_FITTED = ("attention_fraction", "shard_overlap_fraction")


def fitted_hopper_params() -> dict[str, float]:
    """Hopper's fitted values of `HOPPER_FITTED` (those the stored fit holds); empty: not fitted."""
    hopper = _fitted_file().get("hopper", {})
    return {name: float(hopper[name]) for name in HOPPER_FITTED if name in hopper}


def fitted_hopper_attention_fraction() -> float | None:
    """Hopper's `attention_fraction`, fitted to half of the published 2023+ H100/H200 runs; None: not fitted."""
    return fitted_hopper_params().get("attention_fraction")


# Megatron token dispatchers of a mixture of experts (`SoftwareConfig.moe_dispatcher`).
ALL_TO_ALL, FLEX = "alltoall", "flex"


@dataclass(frozen=True)
class SoftwareConfig:
    """How the trainer runs kernels; set by what the framework does, never fitted.

    flash_attention: fused attention; the s x s score matrix is never stored
        and the causal half is skipped.
    sequence_parallel: norms and dropout sharded over TP (Korthikanti et al.).
    dropout: dropout layers present (GPT-3 era); Llama-style training has none.
    overlap_grad_reduce: data-parallel gradient reduction overlaps the last
        microbatch's backward pass, bucket by bucket.
    overlap_param_gather: with ZeRO-1, the all-gather of the updated weights
        runs under the next iteration's forward, bucket by bucket
        (Megatron's --overlap-param-gather), not after the optimizer step.
    grad_reduce_bytes: bytes per gradient element on the wire (4 when bf16
        training reduces in fp32, Megatron's default; 2 for fp16, or for bf16
        gradients: Megatron's --grad-reduce-in-bf16).
    grad_bytes: bytes per element of the gradient buffer the backward accumulates
        into (4: fp32 main gradients, Megatron's default for bf16 and fp16
        training; 2 with bf16 gradients, whose buffer is in the weights' dtype:
        megatron-core DDP `grad_reduce_in_fp32=False`).
    scatter_gather_p2p: pipeline sends split over the TP group (SC'21 sec. 4.1).
    tp_comm_overlap: tensor-parallel collectives decomposed and pipelined with the
        GEMMs that consume or produce them (Megatron's --tp-comm-overlap,
        Transformer Engine userbuffers; `cost_models.compute.exposed_tp_comm_ms`).
    fp8: the transformer layers' linear projections run in FP8 (Transformer
        Engine's delayed scaling, E4M3 forward / E5M2 gradients: Megatron-Core's
        --fp8-format hybrid; torchtitan's float8 converter); attention core,
        norms, embedding and output head stay in BF16 (`cost_models.fp8`).
    moe_dispatcher: how a mixture of experts' tokens reach their experts: "alltoall" (Megatron's all-to-all
        dispatcher, one copy per routed expert) or "flex" (DeepEP/HybridEP kernels: one network copy per
        remote node; `cost_models.expert_parallel`).
    moe_a2a_overlap: Megatron's batch-level EP overlap (--overlap-moe-expert-parallel-comm): the forward of
        one microbatch and the backward of another run as one step, each one's all-to-alls under the block of the
        other's computation run beside it (`cost_models.expert_parallel.overlapped_all_to_all_ms`), where
        megatron-core allows it (`cost_models.expert_parallel.a2a_overlap_applies`).
    attention_kernel: which fused attention kernels run (with flash_attention): "fused", Transformer Engine's
        cuDNN attention or FlashAttention-3 on Hopper and newer, FlashAttention-2 on Ampere (their own best);
        or "fa2", FlashAttention-2 kernels (flash-attn 2, PyTorch SDPA's flash backend) on Hopper or newer,
        which use neither its warpgroup MMA nor TMA (`cost_models.compute.FA2_ATTENTION_TIME_FACTOR`).
    master_weights: the optimizer keeps fp32 master weights and Adam moments beside the bf16/fp16 weights
        (mixed-precision training: Megatron-LM, DeepSpeed, FSDP's mixed precision); False: the model itself is
        bf16 and so are its gradients and Adam moments, as under torch's AdamW on a model cast with
        .to(torch.bfloat16) (`cost_models.memory.optimizer_bytes_per_param`).
    """

    flash_attention: bool = True
    sequence_parallel: bool = True
    dropout: bool = False
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    grad_reduce_bytes: int = 4
    grad_bytes: int = 4
    scatter_gather_p2p: bool = True
    ddp_bucket_params: int = 40_000_000
    tp_comm_overlap: bool = False
    async_tp: bool = False
    fp8: bool = False
    moe_dispatcher: str = "alltoall"
    moe_a2a_overlap: bool = False
    attention_kernel: str = "fused"
    master_weights: bool = True


def tp_overlap_name(software: SoftwareConfig) -> str:
    """The wire's training.tp_comm_overlap for `software`: "megatron" (tp_comm_overlap, which prices both passes
    even with async_tp set), "async_tp" or "none"."""
    if software.tp_comm_overlap:
        return "megatron"
    return "async_tp" if software.async_tp else "none"


# Megatron-LM of 2021-2022 (the calibration runs): no flash attention, dropout
# on, gradient all-reduce after the backward pass, fp16 gradients.
MEGATRON_2021 = SoftwareConfig(
    flash_attention=False,
    sequence_parallel=False,
    dropout=True,
    overlap_grad_reduce=False,
    overlap_param_gather=False,
    grad_reduce_bytes=2,
    scatter_gather_p2p=True,
)
