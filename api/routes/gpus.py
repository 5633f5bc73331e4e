"""/v1/gpus: the GPU presets a request's `cluster.gpu` may name, with their figures and datasheet sources."""

from __future__ import annotations

from fastapi import APIRouter

from api.routes.plans import V1_RESPONSES
from wire.gpu_presets import GpuPreset, gpu_presets

router = APIRouter(prefix="/v1", tags=["gpus"], responses=V1_RESPONSES)


@router.get("/gpus", response_model=list[GpuPreset])
def list_gpus() -> list[GpuPreset]:
    """Every GPU preset: peak dense BF16 and FP8 TFLOP/s, memory, bandwidths and the datasheet they are read
    from. A `cluster.gpu` naming none of them is a 422 listing these names; any other GPU can be given as
    `{"name", "peak_tflops", "memory_gib"}`."""
    return gpu_presets()
