"""GET /v1/gpus and the GPU presets (issue 21): every preset listed with its figures and datasheet source,
the new ones (GH200 96 and 144 GB, MI300X) plannable, and an unknown name a 422 that lists the known ones."""

from __future__ import annotations

import pytest

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
