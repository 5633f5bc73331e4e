"""`GET /v1/gpus`: the GPU presets a request may name, with their figures and datasheet sources."""

from __future__ import annotations

from pydantic import BaseModel, Field

from cost_models.gpu_efficiency import builtin_efficiency
from cost_models.hardware import gpu_preset, gpu_preset_ceiling_source, gpu_preset_names, gpu_preset_source


class GpuPreset(BaseModel):
    """A GPU preset `cluster.gpu` may name: its figures and the datasheet they come from (GET /v1/gpus)."""

    name: str
    peak_bf16_tflops: float = Field(description="Dense (no sparsity) BF16 tensor TFLOP/s.")
    peak_fp8_tflops: float | None = Field(description="Dense FP8 tensor TFLOP/s; null without FP8 tensor cores.")
    memory_gib: float
    hbm_bandwidth_gb_s: float
    intra_node_bandwidth_gb_s: float = Field(description="Unidirectional GPU-to-GPU bandwidth in a node, per GPU.")
    inter_node_bandwidth_gb_s: float = Field(description="The GPU's unidirectional share of the scale-out network.")
    matmul_ceiling_tflops: float | None = Field(
        description="The most dense BF16 matmul TFLOP/s measured on this GPU; GEMMs are priced against it.")
    fp8_matmul_ceiling_tflops: float | None = Field(description="The same for FP8 matmuls; null: not measured.")
    source: str = Field(description="The datasheet (and reference system) each figure is read from.")
    matmul_ceiling_source: str | None = Field(description="The measurement the matmul ceilings are read from.")
    efficiency: dict[str, float] = Field(
        description="The cost model's built-in efficiency parameters on this GPU, what a request without "
                    "options.calibration_id is priced with: the A100 fit, with Hopper's fitted attention_fraction and "
                    "shard_overlap_fraction on GPUs with FP8 tensor cores (README, Efficiency parameters).")


def gpu_presets() -> list[GpuPreset]:
    """Every GPU preset with its figures and datasheet source, by name."""
    out = []
    for name in gpu_preset_names():
        spec = gpu_preset(name)
        out.append(GpuPreset(
            name=name, peak_bf16_tflops=spec.peak_tflops, peak_fp8_tflops=spec.peak_fp8_tflops,
            memory_gib=spec.memory_gib, hbm_bandwidth_gb_s=spec.hbm_bandwidth_gb_s,
            intra_node_bandwidth_gb_s=spec.intra_node_bandwidth_gb_s,
            inter_node_bandwidth_gb_s=spec.inter_node_bandwidth_gb_s, matmul_ceiling_tflops=spec.matmul_ceiling_tflops,
            fp8_matmul_ceiling_tflops=spec.fp8_matmul_ceiling_tflops, source=gpu_preset_source(name),
            matmul_ceiling_source=gpu_preset_ceiling_source(name), efficiency=builtin_efficiency(spec).to_dict(),
        ))
    return out
