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
    """

    name: str
    peak_tflops: float
    memory_gib: float
    hbm_bandwidth_gb_s: float
    intra_node_bandwidth_gb_s: float
    inter_node_bandwidth_gb_s: float
    peak_fp8_tflops: float | None = None

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB


def gpu_preset_names() -> list[str]:
    return sorted(preset_table("gpus.json"))


def gpu_preset(name: str) -> GpuSpec:
    """The preset GPU called `name`; KeyError if there is none."""
    fields = preset_table("gpus.json")[name]
    return GpuSpec(name=name, **{key: value for key, value in fields.items() if key != "source"})


def gpu_preset_source(name: str) -> str:
    """The datasheet a preset's figures are read from; KeyError if there is no such preset."""
    return preset_table("gpus.json")[name]["source"]
