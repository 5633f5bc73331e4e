"""training.optimizer_precision: fp32 master weights and Adam moments (12 bytes a parameter, the default) or a model
trained in bf16 without a master copy (4 bytes of moments, bf16 gradients): priced in memory and in the optimizer
step, planned with, echoed, and refused by the exports whose trainers keep master weights."""

from __future__ import annotations

import pytest

from adapters import deepspeed, megatron, torchtitan
from adapters.registry import ExportError
from api.tasks.planning import estimate_for, plan_for
from planner.errors import PlanningError
from tests.api.support import estimate_request, small_request
from wire.schemas import EstimateRequest, PlanRequest

H100 = {"num_nodes": 1, "gpus_per_node": 8, "gpu": "H100-SXM"}
GIB = 1024**3


def _estimate(optimizer: str | None, **training):
    body = estimate_request({"tp": 8, "pp": 2, "micro_batch_size": 1, "recompute": "full"},
                            cluster={**H100, "num_nodes": 2}, model="llama3-8b",
                            training={"global_batch_size": 16, "seq_length": 4096, "zero_stage": 0, **training}
                            | ({"optimizer_precision": optimizer} if optimizer else {}))
    return estimate_for(EstimateRequest.model_validate(body))


def test_fp32_is_the_default_and_plans_say_which_they_priced():
    default, bf16 = _estimate(None), _estimate("bf16")
    assert default.optimizer_precision == "fp32" and bf16.optimizer_precision == "bf16"
    assert default.predicted.iteration_time_s == _estimate("fp32").predicted.iteration_time_s


def test_state_is_8_bytes_a_parameter_instead_of_18():
    """Without ZeRO every GPU of the first stage holds its parameters' whole state: 2 + 4 + 12 bytes each with
    master weights, 2 + 2 + 4 without; that is all of its static memory (no logits on stage 0)."""
    fp32, bf16 = (_estimate(name).replicas[0].stages[0].static_memory_gib for name in ("fp32", "bf16"))
    assert bf16 / fp32 == pytest.approx(8 / 18, rel=1e-3)


def test_the_optimizer_step_moves_16_bytes_a_parameter_instead_of_34():
    fp32, bf16 = (_estimate(name).predicted.breakdown.optimizer_s for name in ("fp32", "bf16"))
    assert bf16 / fp32 == pytest.approx(16 / 34, rel=1e-3)


def test_gradients_stay_reduced_in_fp32_unless_asked():
    """A bf16 model's gradients are bf16 in memory, but FSDP2-style trainers reduce them in fp32 (reduce_dtype):
    the plan's grad_precision stays fp32 unless the request says bf16, which halves the data-parallel bytes."""
    assert _estimate("bf16").grad_precision == "fp32"
    assert _estimate("bf16", grad_precision="bf16").grad_precision == "bf16"


def test_a_model_that_only_fits_without_master_weights_is_planned():
    """llama3-8b on one 80 GB H100: 8.0B parameters x 18 bytes is 135 GiB, x 8 bytes 60 GiB."""
    def planned(optimizer: str):
        body = small_request(cluster={**H100, "gpus_per_node": 1}, model="llama3-8b",
                             training={"global_batch_size": 4, "seq_length": 4096, "optimizer_precision": optimizer},
                             options={"time_limit_s": 5})
        return plan_for(PlanRequest.model_validate(body))

    with pytest.raises(PlanningError, match="x 18 bytes"):
        planned("fp32")
    plan = planned("bf16")
    assert plan.optimizer_precision == "bf16" and plan.replicas[0].stages[0].memory_gib <= 80 - plan.memory_reserve_gib


def test_bad_values_are_a_422(client):
    body = estimate_request({"tp": 2, "pp": 1}, training={"global_batch_size": 16, "seq_length": 2048,
                                                          "optimizer_precision": "fp8"})
    response = client.post("/v1/estimate", json=body)
    assert response.status_code == 422 and "optimizer_precision" in response.text
    body["training"] |= {"optimizer_precision": "bf16", "precision": "fp16"}
    response = client.post("/v1/estimate", json=body)
    assert response.status_code == 422 and "loss scaling" in response.text


@pytest.mark.parametrize("export", [megatron.megatron_args, deepspeed.deepspeed_config, torchtitan.render])
def test_exports_whose_trainers_keep_master_weights_refuse(export):
    body = small_request(cluster=H100, model="llama3-8b", options={"time_limit_s": 5, "allow_non_uniform": False},
                         training={"global_batch_size": 16, "seq_length": 4096, "optimizer_precision": "bf16"})
    plan = plan_for(PlanRequest.model_validate(body))
    with pytest.raises(ExportError, match="optimizer_precision bf16"):
        export(plan)
    fp32 = plan_for(PlanRequest.model_validate(body | {"training": body["training"] | {"optimizer_precision": "fp32"}}))
    export(fp32)  # the same request with master weights exports
