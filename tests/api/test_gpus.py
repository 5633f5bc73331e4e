"""GET /v1/gpus and the GPU presets (issue 21): every preset listed with its figures and datasheet source,
the new ones (GH200 96 and 144 GB, MI300X) plannable, and an unknown name a 422 that lists the known ones."""

from __future__ import annotations

import pytest

from cost_models.compute import gemm_time_s
from cost_models.efficiency import fitted_efficiency
from cost_models.hardware import gpu_preset
from tests.api.support import assert_detail, small_request, verify_plan

# Datasheet figures, typed in from the vendors' sheets (dense = half the sparse figure NVIDIA prints), not
# read from the preset file: a preset typed wrong fails here.
DATASHEET = {
    "A100-80GB": {"peak_bf16_tflops": 312, "peak_fp8_tflops": None, "memory_gib": 80, "hbm_bandwidth_gb_s": 2039},
    "H100-SXM": {"peak_bf16_tflops": 989, "peak_fp8_tflops": 1979, "memory_gib": 80, "hbm_bandwidth_gb_s": 3350},
    "H200": {"peak_bf16_tflops": 989, "peak_fp8_tflops": 1979, "memory_gib": 141, "hbm_bandwidth_gb_s": 4800},
    "GH200-96GB": {"peak_bf16_tflops": 989, "peak_fp8_tflops": 1979, "memory_gib": 96, "hbm_bandwidth_gb_s": 4000},
    "GH200-144GB": {"peak_bf16_tflops": 989, "peak_fp8_tflops": 1979, "memory_gib": 144, "hbm_bandwidth_gb_s": 4900},
    "MI300X": {"peak_bf16_tflops": 1307, "peak_fp8_tflops": 2615, "memory_gib": 192, "hbm_bandwidth_gb_s": 5300},
}

# The most dense matmul TFLOP/s measured on each GPU (BF16, FP8), typed in from Stas Bekman's ml-engineering,
# compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison table" (v2; GH200 measured on the
# 141 GiB module; the table says H200's BF16 is H100's). None: no row.
MATMUL_CEILINGS = {
    "A100-80GB": (271.2, None), "A100-40GB": (271.2, None), "H100-SXM": (794.5, 1402.6), "H200": (794.5, 1453.4),
    "B200": (1745.0, 3432.5), "GH200-144GB": (828.6, 1535.0), "GH200-96GB": (828.6, 1535.0), "MI300X": (668.4, None),
}


def test_every_preset_is_listed_with_its_figures_and_source(client):
    response = client.get("/v1/gpus")
    assert response.status_code == 200, response.text
    listed = {gpu["name"]: gpu for gpu in response.json()}
    assert set(DATASHEET) <= set(listed)
    for name, figures in DATASHEET.items():
        for field, value in figures.items():
            assert listed[name][field] == value, (name, field, listed[name][field])
    for gpu in listed.values():
        assert gpu["source"].strip(), f"{gpu['name']} has no datasheet source"
        assert "datasheet" in gpu["source"].lower(), gpu["source"]
        # FP8 tensor cores run twice the BF16 rate on every GPU that has them.
        if gpu["peak_fp8_tflops"] is not None:
            assert gpu["peak_fp8_tflops"] == pytest.approx(2 * gpu["peak_bf16_tflops"], rel=2e-3), gpu["name"]
    for name, (bf16, fp8) in MATMUL_CEILINGS.items():
        gpu = listed[name]
        assert (gpu["matmul_ceiling_tflops"], gpu["fp8_matmul_ceiling_tflops"]) == (bf16, fp8), name
        assert bf16 < gpu["peak_bf16_tflops"] and (fp8 is None or fp8 < gpu["peak_fp8_tflops"]), name
        assert "Maximum Achievable Matmul FLOPS" in gpu["matmul_ceiling_source"], name


def test_h100_gemms_run_at_its_measured_ceiling_against_a100s():
    """The built-in GEMM efficiency is fitted on A100s (best matmul 271.2 of 312 TFLOP/s); on an H100 (794.5 of
    989 BF16, 1,402.6 of 1,979 FP8) the same GEMM is priced that much slower against the datasheet peak."""
    h100, a100 = gpu_preset("H100-SXM"), gpu_preset("A100-80GB")
    efficiency = fitted_efficiency()
    flops, width = 2 * 8192 * 4096 * 14336, 4096
    a100_fraction = 271.2 / 312
    assert gemm_time_s(flops, width, a100, efficiency) * 1e12 * 312 == pytest.approx(
        flops / (efficiency.gemm_peak_fraction * width / (width + efficiency.gemm_half_width)), rel=1e-12)
    for fp8, peak, ceiling in ((False, 989, 794.5), (True, 1979, 1402.6)):
        seconds = gemm_time_s(flops, width, h100, efficiency, fp8)
        at_peak_s = gemm_time_s(flops, width, a100, efficiency) * 312 / peak
        assert seconds / at_peak_s == pytest.approx(a100_fraction / (ceiling / peak), rel=1e-12)


def test_a_custom_gpus_ceiling_prices_its_gemms_and_a_ceiling_above_the_peak_is_a_422(client):
    def estimate(**gpu_fields):
        gpu = {"name": "my-gpu", "peak_tflops": 989, "memory_gib": 80, **gpu_fields}
        body = {"cluster": {"num_nodes": 1, "gpus_per_node": 8, "gpu": gpu}, "model": "llama2-7b",
                "training": {"global_batch_size": 16, "seq_length": 2048},
                "options": {"time_limit_s": 5}, "layout": {"tp": 1, "pp": 1}}
        return client.post("/v1/estimate", json=body)

    default, at_a100s, measured = (estimate(), estimate(matmul_ceiling_tflops=989 * 271.2 / 312),
                                   estimate(matmul_ceiling_tflops=600))
    for response in (default, at_a100s, measured):
        assert response.status_code == 200, response.text
    seconds = [response.json()["predicted"]["iteration_time_s"] for response in (default, at_a100s, measured)]
    # without a ceiling a GPU reaches A100's measured fraction of its peak; a lower ceiling is slower
    assert seconds[0] == pytest.approx(seconds[1], rel=1e-9)
    assert seconds[2] > seconds[0] * 1.1
    assert_detail(estimate(matmul_ceiling_tflops=1200), "matmul_ceiling_tflops is 1200", "above peak_tflops (989)")
    assert_detail(estimate(fp8_matmul_ceiling_tflops=1500), "fp8_matmul_ceiling_tflops", "peak_fp8_tflops is not given")
    assert_detail(estimate(peak_fp8_tflops=1979, fp8_matmul_ceiling_tflops=2500), "above peak_fp8_tflops (1979)")


@pytest.mark.parametrize("gpu", ["GH200-96GB", "GH200-144GB", "MI300X"])
def test_a_new_preset_plans(client, gpu):
    body = small_request(cluster={"num_nodes": 2, "gpus_per_node": 4, "gpu": gpu})
    response = client.post("/v1/plan", json=body)
    assert response.status_code == 200, response.text
    plan = verify_plan(response.json(), body)
    assert plan.gpu_memory_gib == DATASHEET[gpu]["memory_gib"]


def test_memory_decides_what_fits(client):
    """llama2-7b unsharded on one GPU (weights, gradients and Adam state, about 112 GB, plus activations) fits
    the 144 GB GH200 and not the 96 GB one, whose 422 names the GiB."""
    def estimate(gpu: str):
        body = {"cluster": {"num_nodes": 1, "gpus_per_node": 1, "gpu": gpu}, "model": "llama2-7b",
                "training": {"global_batch_size": 4, "seq_length": 2048, "zero_stage": 0},
                "options": {"time_limit_s": 5}, "layout": {"tp": 1, "pp": 1, "recompute": "full"}}
        return client.post("/v1/estimate", json=body), body

    fits, body = estimate("GH200-144GB")
    assert fits.status_code == 200, fits.text
    assert verify_plan(fits.json(), body).replicas[0].stages[0].memory_gib > 96
    assert_detail(estimate("GH200-96GB")[0], "GiB", "GH200-96GB")


def test_an_unknown_gpu_is_a_422_listing_the_presets(client):
    body = small_request(cluster={"num_nodes": 1, "gpus_per_node": 8, "gpu": "H300"})
    detail = assert_detail(client.post("/v1/plan", json=body), "unknown GPU preset 'H300'")
    for name in ("A100-80GB", "GH200-96GB", "GH200-144GB", "MI300X"):
        assert name in detail
