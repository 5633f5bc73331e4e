"""The built-in efficiency parameters of one GPU: the A100 fit, with Hopper's attention and FSDP overlap on
Hopper or newer.

The A100 runs the parameters are fitted on (SC'21, Korthikanti et al.) ran unfused attention, so they say
nothing of how fast fused attention runs (`attention_fraction`, held at 1 there). The published 2023+
H100/H200 runs do: fitted to every other dense run of each source (`python -m benchmarks.fidelity --fit`,
the rest held out), their attention reaches about half of the modelled kernels' speed (the FlashAttention-2
and -3 papers' H100 benchmark figures), and fitted to either half alone the value moves by 7% (0.524, 0.562,
fitted with the FSDP overlap below), where refitting the GEMM half width with it moves that by 5x between the
halves: the runs pin attention down, not GEMM widths. Kernel benchmarks time one attention call on large, even shapes; a training step's
attention also pays causal tiles cut at the diagonal, rotary embeddings, layout copies and, with context
parallelism, the merge of partial results, which is where the fitted fraction reads as an effective value.

The A100 runs shard nothing per layer either (ZeRO-1 at most), so they cannot say how much of ZeRO-3/FSDP's
per-layer traffic hides under compute (`shard_overlap_fraction`): the published FSDP runs (llm-foundry's MPT
table, KempnerForge's) say, fitted with attention to the same half: they hide a third to a half of it (0.33 fitted
to one half, 0.51 to the other), not all. KempnerForge's 7B step grows from one node to eight by nearly its whole
FSDP traffic at the network's rate, and MPT-7B's by 8% from 128 to 512 GPUs, where hiding it all prices no growth.
torchtitan's own FSDP runs hide more (2.7% lost from 8 to 128 H100s; 5.5% priced at Hopper's value), so a stack
that overlaps as designed calibrates it back toward 1.

A GPU with FP8 tensor cores (Hopper or newer: H100, H200, GH200, B200, MI300X, or a GPU given by its figures
with `peak_fp8_tflops`) takes Hopper's values, the same line `training.attention_kernel: "fa2"` draws; the
others keep the A100 fit whole.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache

from collections.abc import Mapping

from cost_models.efficiency import EfficiencyParams, fitted_efficiency, fitted_hopper_params
from cost_models.hardware import GpuSpec


def is_hopper_class(gpu: GpuSpec) -> bool:
    """Hopper or newer: FP8 tensor cores."""
    return gpu.peak_fp8_tflops is not None


def efficiency_for_gpu(gpu: GpuSpec, base: EfficiencyParams, hopper: Mapping[str, float] | None) -> EfficiencyParams:
    """`base` (the A100 fit), with `hopper`'s values (`cost_models.efficiency.HOPPER_FITTED`) on a Hopper-class GPU;
    `base` without them."""
    if not hopper or not is_hopper_class(gpu):
        return base
    return replace(base, **hopper)


@cache
def builtin_efficiency(gpu: GpuSpec) -> EfficiencyParams:
    """What the service prices `gpu` with when no calibration is named (the stored fits)."""
    return efficiency_for_gpu(gpu, fitted_efficiency(), fitted_hopper_params())
