"""GPU specifications and presets."""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.preset_files import preset_table

GIB = 1024**3


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model and its links.

    peak_tflops: dense bf16 TFLOP/s.
    memory_gib: HBM capacity in GiB.
    hbm_bandwidth_gb_s: HBM bandwidth, GB/s (memory-bound kernels).
    intra_node_bandwidth_gb_s: unidirectional NVLink/NVSwitch GB/s per GPU.
    inter_node_bandwidth_gb_s: unidirectional network GB/s per GPU.
    peak_fp8_tflops: dense FP8 TFLOP/s; None without FP8 tensor cores.
    matmul_ceiling_tflops: the most dense BF16 matmul TFLOP/s measured on this GPU (the best of a sweep of
        shapes: below the datasheet peak, which assumes the boost clock under any load); None: not measured.
    fp8_matmul_ceiling_tflops: the same for FP8 matmuls; None: not measured (or no FP8).
    """

    name: str
    peak_tflops: float
    memory_gib: float
    hbm_bandwidth_gb_s: float
    intra_node_bandwidth_gb_s: float
    inter_node_bandwidth_gb_s: float
    peak_fp8_tflops: float | None = None
    matmul_ceiling_tflops: float | None = None
    fp8_matmul_ceiling_tflops: float | None = None

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB


# What a preset entry says about where its figures come from, beside the figures themselves.
_SOURCE_KEYS = ("source", "matmul_ceiling_source")
# The GPU of the runs the built-in efficiency parameters are fitted on (SC'21, Korthikanti et al.: DGX A100 80GB).
FIT_REFERENCE_GPU = "A100-80GB"


def gpu_preset_names() -> list[str]:
    return sorted(preset_table("gpus.json"))


def gpu_preset(name: str) -> GpuSpec:
    """The preset GPU called `name`; KeyError if there is none."""
    fields = preset_table("gpus.json")[name]
    return GpuSpec(name=name, **{key: value for key, value in fields.items() if key not in _SOURCE_KEYS})


def gpu_preset_source(name: str) -> str:
    """The datasheet a preset's figures are read from; KeyError if there is no such preset."""
    return preset_table("gpus.json")[name]["source"]


def gpu_preset_ceiling_source(name: str) -> str | None:
    """The measurement a preset's matmul ceilings are read from (None: none published); KeyError if there is
    no such preset."""
    return preset_table("gpus.json")[name].get("matmul_ceiling_source")
