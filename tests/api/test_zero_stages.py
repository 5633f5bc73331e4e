"""ZeRO-2 and ZeRO-3 through the wire: accepted, planned on stock layouts, chosen by `zero_stage: auto`."""

from __future__ import annotations

import pytest

from adapters.stock import stock_layout
from api.tasks.planning import estimate_for, plan_for
from planner.errors import PlanningError
from tests.api.support import assert_detail, estimate_request, small_request, verify_plan
from wire.schemas import EstimateRequest, PlanRequest

H100_16 = {"num_nodes": 2, "gpus_per_node": 8, "gpu": "H100-SXM"}
STOCK = {"time_limit_s": 5, "allow_non_uniform": False}
# Two huge single-head layers on one node of 40 GB cards: tp must be 1 and pp at most 2, so ZeRO-1's
# replicated weights and gradients cannot fit, while sharding the gradients (or the weights) over the
# four replicas of each stage can.
WIDE_TWO_LAYERS = {"num_layers": 2, "hidden_size": 16384, "ffn_hidden_size": 61440, "num_attention_heads": 1,
                   "num_kv_heads": 1, "vocab_size": 32000, "swiglu": True, "tied_embeddings": False}


def _llama3_8b(zero, **options):
    return small_request(cluster=H100_16, model="llama3-8b",
                         training={"global_batch_size": 64, "seq_length": 8192, "zero_stage": zero},
                         options={**STOCK, **options})


def _plan(body):
    return plan_for(PlanRequest.model_validate(body))


def test_auto_plans_every_stage_and_keeps_the_fastest():
    explicit = {stage: _plan(_llama3_8b(stage)) for stage in (1, 2, 3)}
    body = _llama3_8b("auto")
    chosen = _plan(body)
    verify_plan(chosen.model_dump(mode="json"), body)
    fastest = min(explicit, key=lambda stage: (explicit[stage].predicted.iteration_time_s, stage))
    assert chosen.zero_stage == fastest
    assert chosen.predicted.iteration_time_s == explicit[fastest].predicted.iteration_time_s
    assert all(chosen.predicted.iteration_time_s <= plan.predicted.iteration_time_s for plan in explicit.values())
    # every stage's search proved its plan, so the answer is optimal over the three spaces together
    assert all(plan.status == "optimal" for plan in explicit.values()) and chosen.status == "optimal"
    assert chosen.solver.bound_ms == pytest.approx(1000 * chosen.predicted.iteration_time_s, abs=0.01)
    note = chosen.solver.notes[-1]
    for stage, plan in explicit.items():
        assert f"zero_stage {stage}: {plan.predicted.iteration_time_s:.4f} s" in note
    # the premise that makes the choice matter here: the stages do not all tie
    assert len({plan.predicted.iteration_time_s for plan in explicit.values()}) == 3


def test_auto_finds_a_layout_where_zero_1_has_none():
    def body(zero):
        return small_request(cluster={"num_nodes": 1, "gpus_per_node": 8, "gpu": "A100-40GB"}, model=WIDE_TWO_LAYERS,
                             training={"global_batch_size": 16, "seq_length": 512, "zero_stage": zero},
                             options={"time_limit_s": 5})

    with pytest.raises(PlanningError, match=r"even the leanest \(tp=1, pp=2, dp=4, zero_stage=1"):
        _plan(body(1))
    chosen = _plan(body("auto"))
    verify_plan(chosen.model_dump(mode="json"), body("auto"))
    assert chosen.zero_stage in (2, 3)
    assert "zero_stage 1: no layout (no layout fits in memory" in chosen.solver.notes[-1]


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_2_and_3_plan_stock_layouts_even_where_non_uniform_ones_are_allowed(stage):
    body = small_request(failures={"failed": ["1:3"]}, training={"global_batch_size": 32, "seq_length": 2048,
                                                                 "zero_stage": stage}, options={"time_limit_s": 5})
    plan = _plan(body)
    verify_plan(plan.model_dump(mode="json"), body)
    assert plan.zero_stage == stage
    layout = stock_layout(plan, "test")  # raises, naming what differs, on a non-uniform plan
    assert layout.zero_stage == stage


def test_sharding_more_holds_less_on_the_same_layout():
    memory = {}
    for stage in (1, 2, 3):
        plan = estimate_for(EstimateRequest.model_validate(estimate_request(
            {"tp": 1, "pp": 1, "dp": 32, "recompute": "full"}, training={"global_batch_size": 64, "seq_length": 4096,
                                                                        "zero_stage": stage})))
        memory[stage] = plan.replicas[0].stages[0].memory_gib
    assert memory[1] > memory[2] > memory[3]


def test_zero_stage_4_is_refused(client):
    body = small_request(training={"global_batch_size": 32, "seq_length": 2048, "zero_stage": 4})
    assert_detail(client.post("/v1/plan", json=body), "zero_stage")


def test_an_estimate_refuses_auto(client):
    body = estimate_request({"tp": 1, "pp": 1}, training={"global_batch_size": 256, "seq_length": 4096,
                                                         "zero_stage": "auto"})
    assert_detail(client.post("/v1/estimate", json=body), "an estimate prices one stage: give 0, 1, 2 or 3")


def test_an_uneven_zero_3_estimate_does_not_suggest_what_cannot_help(client):
    # 15 microbatches over 4 replicas: unequal counts are how a ZeRO-1 estimate with allow_non_uniform runs it,
    # but ZeRO-2/3 layouts are stock ones, so the advice must name the stage, not the option alone.
    body = estimate_request({"tp": 2, "pp": 4, "dp": 4}, training={"global_batch_size": 15, "seq_length": 4096,
                                                                  "zero_stage": 3})
    detail = assert_detail(client.post("/v1/estimate", json=body), "do not split evenly over dp 4")
    assert "zero_stage 0 or 1 with options.allow_non_uniform: true" in detail
    at_zero_1 = estimate_request({"tp": 2, "pp": 4, "dp": 4}, training={"global_batch_size": 15, "seq_length": 4096},
                                 options={"time_limit_s": 2, "allow_non_uniform": False})
    assert "(options.allow_non_uniform: true)" in assert_detail(client.post("/v1/estimate", json=at_zero_1),
                                                                  "do not split evenly over dp 4")
