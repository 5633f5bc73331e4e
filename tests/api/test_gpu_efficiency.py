"""Each GPU's built-in parameters: the A100 fit, with Hopper's fitted attention fraction on GPUs with FP8 tensor
cores (`cost_models.gpu_efficiency`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cost_models.efficiency import fitted_efficiency, fitted_hopper_attention_fraction, fitted_hopper_params
from cost_models.gpu_efficiency import builtin_efficiency, efficiency_for_gpu
from cost_models.hardware import GpuSpec, gpu_preset
from wire.convert import to_problem
from wire.schemas import PlanRequest


def _custom(peak_fp8_tflops: float | None) -> GpuSpec:
    return GpuSpec(name="custom", peak_tflops=989, memory_gib=80, hbm_bandwidth_gb_s=3000,
                   intra_node_bandwidth_gb_s=450, inter_node_bandwidth_gb_s=50, peak_fp8_tflops=peak_fp8_tflops)


def test_hoppers_attention_is_fitted_below_the_modelled_kernels_speed():
    """The A100 fit holds attention at the kernels' modelled speed (its runs ran unfused attention); Hopper's is
    fitted, an interior value of the range a calibration may take."""
    hopper = fitted_hopper_attention_fraction()
    assert fitted_efficiency().attention_fraction == 1.0
    assert hopper is not None and 0.3 < hopper < 0.9


def test_hoppers_fsdp_overlap_is_fitted_inside_its_range():
    """The A100 fit hides all of FSDP's per-layer traffic it can (its runs shard nothing per layer); Hopper's share
    is fitted to the published FSDP runs, strictly inside the range a calibration may take."""
    assert fitted_efficiency().shard_overlap_fraction == 1.0
    assert 0.02 < fitted_hopper_params()["shard_overlap_fraction"] < 1.0


@pytest.mark.parametrize("name", ["A100-40GB", "A100-80GB"])
def test_ampere_keeps_the_a100_fit_whole(name):
    assert builtin_efficiency(gpu_preset(name)) == fitted_efficiency()


@pytest.mark.parametrize("name", ["H100-SXM", "H200", "GH200-96GB", "GH200-144GB", "B200", "MI300X"])
def test_gpus_with_fp8_tensor_cores_take_hoppers_fitted_parameters_and_nothing_else(name):
    assert builtin_efficiency(gpu_preset(name)) == replace(fitted_efficiency(),
                                                           attention_fraction=fitted_hopper_attention_fraction(),
                                                           shard_overlap_fraction=fitted_hopper_params()["shard_overlap_fraction"])


def test_a_gpu_given_by_its_figures_is_placed_by_its_fp8_tensor_cores():
    assert builtin_efficiency(_custom(None)) == fitted_efficiency()
    assert builtin_efficiency(_custom(1979)).attention_fraction == fitted_hopper_attention_fraction()


def test_without_a_hopper_fit_every_gpu_keeps_the_a100_fit():
    base = fitted_efficiency()
    for name in ("H100-SXM", "B200", "A100-80GB"):
        assert efficiency_for_gpu(gpu_preset(name), base, None) == base


def _body(gpu: str) -> dict:
    return {"cluster": {"num_nodes": 1, "gpus_per_node": 8, "gpu": gpu}, "model": "llama2-7b",
            "training": {"global_batch_size": 16, "seq_length": 2048}}


@pytest.mark.parametrize(("gpu", "hopper"), [("H100-SXM", True), ("A100-80GB", False)])
def test_a_plan_request_is_priced_with_its_gpus_parameters(gpu, hopper):
    fraction = to_problem(PlanRequest.model_validate(_body(gpu))).efficiency.attention_fraction
    assert fraction == (fitted_hopper_attention_fraction() if hopper else 1.0)


def test_hoppers_attention_slows_long_sequences_far_more_than_short_ones(client):
    """/v1/estimate on a GPU given by H100's figures, with FP8 tensor cores and without (so priced with the A100
    fit's attention), the same BF16 run: attention grows with the sequence and the GEMMs per token do not, so
    Hopper's fitted attention costs a 32k-token run far more than a 2k one."""
    figures = {"name": "h100-figures", "peak_tflops": 989, "memory_gib": 80, "hbm_bandwidth_gb_s": 3350,
               "matmul_ceiling_tflops": 794.5}

    def seconds(gpu, seq_length: int) -> float:
        body = {"cluster": {"num_nodes": 1, "gpus_per_node": 8, "gpu": gpu}, "model": "llama2-7b",
                "training": {"global_batch_size": 8, "seq_length": seq_length, "recompute": "full"},
                "options": {"time_limit_s": 5}, "layout": {"tp": 1, "pp": 1}}
        response = client.post("/v1/estimate", json=body)
        assert response.status_code == 200, response.text
        return response.json()["predicted"]["iteration_time_s"]

    hopper = {**figures, "peak_fp8_tflops": 1979}
    short, long = (seconds(hopper, s) / seconds(figures, s) for s in (2048, 32768))
    assert 1.0 < short < 1.1 < 1.3 < long


def test_the_gpu_listing_says_which_parameters_each_preset_is_priced_with(client):
    response = client.get("/v1/gpus")
    assert response.status_code == 200, response.text
    listed = {gpu["name"]: gpu["efficiency"] for gpu in response.json()}
    assert listed["A100-80GB"] == fitted_efficiency().to_dict()
    assert listed["H100-SXM"] == {**fitted_efficiency().to_dict(), **fitted_hopper_params()}
