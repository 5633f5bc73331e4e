"""Mixtures of experts in the reference executor, with the experts split over expert-parallel ranks: each EP
rank holds its block of every layer's routed experts, runs them on the tokens of its whole EP group (gathered)
and sums their outputs back to each token's rank, and only the replicas holding an expert sync its gradients.

One world of 8 gloo processes runs four cases against one process training the whole batch (the same model
without expert parallelism): ep 2 over pipelines of 2 stages (4 replicas, so 2 EP groups), and ep 2 under a
zero-bubble schedule (input and weight gradients apart), with SGD; and the pipelines again with Adam, its moments
sharded by ZeRO-1 (each expert's over the 2 replicas holding it, the rest over all 4) and unsharded (ZeRO-0),
against PyTorch's own Adam. The model has a dense first layer, 4 routed experts (top 2) and a shared expert, as
DeepSeek-style models do.
"""

from __future__ import annotations

import pytest

from api.tasks.planning import estimate_for
from executor import layout as executor_layout
from executor import model as executor_model
from executor import run as executor_run
from tests.executor.support import LR, SEQ_LENGTH, TINY, Case, losses, mismatches, relative_error, replica_states, run_world
from tests.executor.test_executor import STEPS, TOLERANCE
from wire.schemas import EstimateRequest, ModelArchitecture, Plan

PLANNED = {"num_layers": 4, "hidden_size": 4096, "ffn_hidden_size": 14336, "num_attention_heads": 32,
           "num_kv_heads": 8, "vocab_size": 32000, "swiglu": True, "tied_embeddings": False, "num_experts": 4,
           "experts_per_token": 2, "shared_expert_ffn_hidden_size": 4096, "dense_layers": 1,
           "dense_ffn_hidden_size": 14336}
TINY_MOE = ModelArchitecture(num_layers=4, name="tiny-moe", **{**TINY, "ffn_hidden_size": 32}, num_experts=4,
                             experts_per_token=2, shared_expert_ffn_hidden_size=32, dense_layers=1,
                             dense_ffn_hidden_size=64)


ADAM_LR, ADAM_STEPS = 1e-3, 4
ADAM_LOSS_TOLERANCE, ADAM_PARAM_TOLERANCE = 1e-4, 5e-4  # as tests/executor/test_context_parallel.py


def _estimate(gpus: int, layout: dict, zero_stage: int = 1) -> Plan:
    plan = estimate_for(EstimateRequest.model_validate({
        "cluster": {"num_nodes": 1, "gpus_per_node": gpus, "gpu": "A100-80GB"}, "model": PLANNED,
        "training": {"global_batch_size": 8, "seq_length": 4096, "zero_stage": zero_stage},
        "layout": {"micro_batch_size": 1, **layout}}))
    return plan.model_copy(update={"architecture": TINY_MOE, "seq_length": SEQ_LENGTH})


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    pipelines = {"tp": 1, "pp": 2, "dp": 4, "ep": 2}
    return {"pipelines": _estimate(8, pipelines),
            "zero-bubble": _estimate(4, {"tp": 1, "pp": 2, "dp": 2, "ep": 2, "schedule": "zb-h1"}),
            "adam-zero-1": _estimate(8, pipelines, zero_stage=1),
            "adam-zero-0": _estimate(8, pipelines, zero_stage=0)}


@pytest.fixture(scope="module")
def runs(plans, tmp_path_factory) -> dict[str, Case]:
    tmp = tmp_path_factory.mktemp("expert-parallel")
    cases = [Case(name, plan.model_dump_json(),
                  executor_run.Options(steps=ADAM_STEPS, lr=ADAM_LR, optimizer="adam") if name.startswith("adam")
                  else executor_run.Options(steps=STEPS, lr=LR), str(tmp / name))
             for name, plan in plans.items()]
    run_world(cases, 8, tmp)
    return {case.name: case for case in cases}


def _assert_trains_like_one_process(plan: Plan, out_dir: str, adam: bool = False) -> None:
    """Every step's loss, and every parameter on every replica holding it (an expert lives on one replica of each
    EP group), match the single-process run; together the replicas hold every parameter."""
    layout = executor_layout.build_layout(plan)
    steps, lr, optimizer = (ADAM_STEPS, ADAM_LR, "adam") if adam else (STEPS, LR, "sgd")
    loss_tolerance, param_tolerance = (ADAM_LOSS_TOLERANCE, ADAM_PARAM_TOLERANCE) if adam else (TOLERANCE, TOLERANCE)
    ref_losses, initial, ref_final = executor_model.reference_train(
        executor_model.model_config(plan), layout.global_batch_size, steps, 0, lr, optimizer)
    got = losses(out_dir)
    assert len(got) == steps
    for step, (a, b) in enumerate(zip(got, ref_losses, strict=True)):
        assert abs(a - b) <= loss_tolerance * abs(b), f"step {step}: loss {a} != reference {b}"
    held: set[str] = set()
    for replica, state in replica_states(out_dir).items():
        problems = mismatches(state, {name: ref_final[name] for name in state}, param_tolerance)
        assert not problems, f"replica {replica}: " + "; ".join(problems)
        experts = {name.split(".")[4] for name in state if ".experts." in name}
        assert len(experts) == plan.architecture.num_experts // plan.ep  # its block only
        held |= set(state)
    assert held == set(ref_final)
    moved = sorted(relative_error(ref_final[name], initial[name]) for name in ref_final if ".experts." in name)
    assert moved[len(moved) // 2] > 10 * param_tolerance, f"{optimizer} barely moved the experts; the test would be blind"


def test_the_plans_are_what_the_tests_claim(plans):
    assert [(plan.ep, len(plan.replicas), len(plan.replicas[0].stages), plan.zero_stage) for plan in plans.values()] == [
        (2, 4, 2, 1), (2, 2, 2, 1), (2, 4, 2, 1), (2, 4, 2, 0)]
    assert plans["zero-bubble"].schedule == "zb-h1"
    assert {stage.tp for plan in plans.values() for replica in plan.replicas for stage in replica.stages} == {1}


def test_expert_parallel_pipelines_train_like_one_process(plans, runs):
    _assert_trains_like_one_process(plans["pipelines"], runs["pipelines"].out_dir)


def test_expert_parallelism_under_a_zero_bubble_schedule_trains_like_one_process(plans, runs):
    _assert_trains_like_one_process(plans["zero-bubble"], runs["zero-bubble"].out_dir)


def test_sharded_adam_trains_experts_like_one_process(plans, runs):
    """ZeRO-1: each routed expert's moments split between the 2 replicas holding it, the replicated weights'
    over all 4; dropping the owners' sum of their updated halves, or giving every holder the whole expert,
    fails it."""
    _assert_trains_like_one_process(plans["adam-zero-1"], runs["adam-zero-1"].out_dir, adam=True)


def test_unsharded_adam_trains_experts_like_one_process(plans, runs):
    _assert_trains_like_one_process(plans["adam-zero-0"], runs["adam-zero-0"].out_dir, adam=True)


def test_what_the_executor_does_not_run_with_experts_is_refused_by_name(plans):
    plan = plans["zero-bubble"]
    with pytest.raises(ValueError, match="mixture of experts on one plan only"):
        executor_run.run(plan, executor_run.Options(checkpoint_every=1, checkpoint_dir="/nonexistent"))
    wide = _estimate(4, {"tp": 2, "pp": 1, "dp": 2, "ep": 2})
    with pytest.raises(ValueError, match="ep 2 with stages of several devices.*megatron or torchtitan"):
        executor_layout.build_layout(wide.model_copy(update={"architecture": TINY_MOE}))
