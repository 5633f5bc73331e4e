"""A custom GPU in a request's `cluster.gpu`: its datasheet figures and, optionally, what was measured on it."""

from __future__ import annotations

from pydantic import Field, model_validator

from wire.strict import _Strict

# Lower bounds keep every derived time finite: near-zero rates make times overflow to inf (a 500, or NaN in the
# answer). Each is far below any accelerator a training job runs on.
MIN_PEAK_TFLOPS = 0.1
MIN_MEMORY_GIB = 0.1
MIN_BANDWIDTH_GB_S = 0.01


class GpuObject(_Strict):
    name: str = Field(min_length=1, max_length=64)
    peak_tflops: float = Field(ge=MIN_PEAK_TFLOPS, le=100_000, description="Dense bf16 TFLOP/s per GPU.")
    memory_gib: float = Field(ge=MIN_MEMORY_GIB, le=4096, description="HBM capacity per GPU, GiB.")
    hbm_bandwidth_gb_s: float | None = Field(
        default=None, ge=MIN_BANDWIDTH_GB_S, le=100_000,
        description="HBM bandwidth GB/s; default scales A100's by peak FLOP/s.",
    )
    peak_fp8_tflops: float | None = Field(
        default=None, ge=MIN_PEAK_TFLOPS, le=200_000,
        description="Dense FP8 TFLOP/s per GPU; null: the GPU has no FP8 tensor cores (precision fp8 is refused).",
    )
    matmul_ceiling_tflops: float | None = Field(
        default=None, ge=MIN_PEAK_TFLOPS, le=100_000,
        description="The most dense BF16 matmul TFLOP/s measured on this GPU (e.g. ml-engineering's mamf-finder.py); "
                    "GEMMs are priced against it. Default: A100's measured fraction of peak_tflops (86.9%).",
    )
    fp8_matmul_ceiling_tflops: float | None = Field(
        default=None, ge=MIN_PEAK_TFLOPS, le=200_000,
        description="The same for FP8 matmuls. Default: the fraction of peak_fp8_tflops that BF16 reaches of "
                    "peak_tflops.",
    )

    @model_validator(mode="after")
    def _ceilings_below_peaks(self) -> GpuObject:
        pairs = (("matmul_ceiling_tflops", self.matmul_ceiling_tflops, "peak_tflops", self.peak_tflops),
                 ("fp8_matmul_ceiling_tflops", self.fp8_matmul_ceiling_tflops, "peak_fp8_tflops", self.peak_fp8_tflops))
        for ceiling_name, ceiling, peak_name, peak in pairs:
            if ceiling is None:
                continue
            if peak is None:
                raise ValueError(f"{ceiling_name} is {ceiling:g} but {peak_name} is not given: a GPU without FP8 "
                                 "tensor cores has no FP8 matmul ceiling")
            if ceiling > peak:
                raise ValueError(f"{ceiling_name} is {ceiling:g} TFLOP/s, above {peak_name} ({peak:g}): a measured "
                                 "matmul cannot beat the datasheet peak; give dense (no sparsity) figures")
        return self
