"""bf16 gradients (`training.grad_precision`): half the gradient memory and half the data-parallel traffic, as
Megatron-LM's --grad-reduce-in-bf16 runs them; refused where they cannot exist."""

from __future__ import annotations

import pytest

from api.tasks.planning import estimate_for
from cost_models.memory import state_bytes_per_param
from planner.errors import PlanningError
from tests.api.support import assert_detail, estimate_request
from wire.schemas import EstimateRequest

GIB = 2**30
# llama2-7b as published (Touvron et al. 2023, config.json): hidden 4096, MLP 11008 (SwiGLU), 32 layers,
# vocabulary 32000, RMSNorm; a layer is 4 h^2 attention + 3 h f MLP + 2 h norms
LLAMA2_7B_LAYER = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
LLAMA2_7B_EMBEDDING = 32000 * 4096


def _estimate(layout: dict, **training):
    body = estimate_request(layout, training={"global_batch_size": 256, "seq_length": 4096, **training})
    return estimate_for(EstimateRequest.model_validate(body))


@pytest.mark.parametrize("zero, dp", [(0, 8), (1, 8), (2, 32)])
def test_bf16_gradients_hold_two_bytes_a_parameter_less(zero, dp):
    layout = {"tp": 2, "pp": 2} if zero < 2 else {"tp": 1, "pp": 1}
    fp32 = _estimate({**layout, "dp": dp}, zero_stage=zero)
    bf16 = _estimate({**layout, "dp": dp}, zero_stage=zero, grad_precision="bf16")
    assert (fp32.grad_precision, bf16.grad_precision) == ("fp32", "bf16")
    stage = fp32.replicas[0].stages[0]
    layers = stage.layers[1] - stage.layers[0]
    head = LLAMA2_7B_EMBEDDING + 4096 if len(fp32.replicas[0].stages) == 1 else 0  # untied head and final norm
    params_per_gpu = (layers * LLAMA2_7B_LAYER + LLAMA2_7B_EMBEDDING + head) / stage.tp
    shard = dp if zero >= 2 else 1  # ZeRO-2 shards the gradients over the replicas
    saved_gib = stage.memory_gib - bf16.replicas[0].stages[0].memory_gib
    assert saved_gib == pytest.approx(params_per_gpu * 2 / shard / GIB, abs=0.002)
    # the memory model's own table, written for the check: 16 bytes, or 14 + 2 / d with ZeRO-1
    assert state_bytes_per_param(zero, dp, 2) == state_bytes_per_param(zero, dp) - 2 / shard


def test_bf16_gradients_halve_the_gradient_traffic():
    """ZeRO-3's per-layer reduce-scatters and step-end sync move 2 bytes a gradient instead of 4."""
    layout = {"tp": 1, "pp": 1, "dp": 32, "micro_batch_size": 1, "recompute": "full"}
    fp32 = _estimate(layout, zero_stage=3)
    bf16 = _estimate(layout, zero_stage=3, grad_precision="bf16")
    assert bf16.predicted.breakdown.dp_comm_s < fp32.predicted.breakdown.dp_comm_s
    assert bf16.predicted.iteration_time_s <= fp32.predicted.iteration_time_s


def test_fp16_training_keeps_its_own_gradients(client):
    body = estimate_request({"tp": 2, "pp": 2}, training={"global_batch_size": 256, "seq_length": 4096,
                                                          "precision": "fp16", "grad_precision": "bf16"})
    assert_detail(client.post("/v1/estimate", json=body), "grad_precision bf16 with precision fp16")
    fp16 = estimate_for(EstimateRequest.model_validate(estimate_request(
        {"tp": 2, "pp": 2}, training={"global_batch_size": 256, "seq_length": 4096, "precision": "fp16"})))
    assert fp16.grad_precision is None


def test_what_nothing_fits_says_counts_the_gradients_as_asked():
    body = estimate_request({"tp": 8, "pp": 4}, model="llama3-405b",
                            cluster={"num_nodes": 1, "gpus_per_node": 8, "gpu": "A100-80GB"},
                            training={"global_batch_size": 8, "seq_length": 4096, "grad_precision": "bf16"})
    from api.tasks.planning import plan_for
    from wire.schemas import PlanRequest

    body.pop("layout")
    with pytest.raises(PlanningError, match=r"x 16 bytes"):
        plan_for(PlanRequest.model_validate(body))


@pytest.mark.parametrize("precision, grad_precision, wire_bytes, buffer_bytes", [
    ("bf16", None, 4, 4), ("bf16", "fp32", 4, 4), ("bf16", "bf16", 2, 2), ("fp8", "bf16", 2, 2),
    ("fp16", None, 2, 4),  # fp16: reduced in fp16, accumulated in fp32 main gradients
])
def test_the_request_sets_what_the_cost_model_moves_and_holds(precision, grad_precision, wire_bytes, buffer_bytes):
    from wire.convert import to_problem
    from wire.schemas import PlanRequest

    training = {"global_batch_size": 64, "seq_length": 2048, "precision": precision}
    if grad_precision:
        training["grad_precision"] = grad_precision
    body = {"cluster": {"num_nodes": 1, "gpus_per_node": 8, "gpu": "H100-SXM"}, "model": "llama2-7b",
            "training": training}
    software = to_problem(PlanRequest.model_validate(body)).software
    assert (software.grad_reduce_bytes, software.grad_bytes) == (wire_bytes, buffer_bytes)
