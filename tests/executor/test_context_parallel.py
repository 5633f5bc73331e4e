"""Context parallelism in the reference executor: each sequence split over a stage's CP ranks (Megatron-LM's
load-balanced causal pieces), attention over keys and values gathered from every CP rank, trains to the numbers
of one process.

One world of 8 gloo processes runs four cases: a uniform tp 2 x cp 2 layout with the executor's sharded Adam
(ZeRO-1 over replicas x CP ranks) against `torch.optim.Adam`; an interleaved cp 2 pipeline; a plan mixing,
stage by stage, whole-sequence TP-2 stages with CP-2 stages (the executor runs what a plan says, whatever the
planner would choose), against a single-process SGD reference; and a run switching live from whole sequences
to CP and back, moving its state by the migration model's transfers.
"""

from __future__ import annotations

import pytest

from api.tasks.planning import estimate_for
from executor import layout as executor_layout
from executor import model as executor_model
from executor import run as executor_run
from tests.executor.support import LR, Case, losses, mismatches, replica_states, run_world, tiny, used_devices
from tests.executor.test_executor import STEPS, _assert_trains_like_one_process
from wire.schemas import EstimateRequest, Plan

ADAM_LR, ADAM_STEPS = 1e-3, 4
SWITCHES, SWITCH_STEPS = (2, 4), 6
ADAM_LOSS_TOLERANCE, ADAM_PARAM_TOLERANCE = 1e-4, 5e-4  # as tests/executor/test_reconfigure.py, for the same reasons


def _request(layout: dict, zero_stage: int = 1) -> EstimateRequest:
    return EstimateRequest.model_validate({
        "cluster": {"num_nodes": 1, "gpus_per_node": 8, "gpu": "A100-80GB"},
        "model": {"num_layers": 8, "hidden_size": 4096, "ffn_hidden_size": 16384, "num_attention_heads": 32,
                  "num_kv_heads": 8, "vocab_size": 32000, "swiglu": True, "tied_embeddings": False},
        "training": {"global_batch_size": 8, "seq_length": 4096, "zero_stage": zero_stage},
        "layout": {"micro_batch_size": 1, **layout}})


def _estimate(layout: dict, zero_stage: int = 1) -> Plan:
    return tiny(estimate_for(_request(layout, zero_stage)))


def _moved_to(old: Plan, new: Plan) -> Plan:
    """`new` as a replan of `old`: the service's migration model's transfers between the two layouts (the same
    function a replan answers with, `planner.replan.choice.plan_migration`)."""
    from planner.replan.choice import plan_migration
    from wire.convert import to_problem
    from wire.migration import Migration, transfer_to_wire

    cost = plan_migration(to_problem(_request({"tp": 1, "pp": 1})), old, new)
    migration = Migration(bytes_moved=cost.bytes_moved, devices_changed=list(cost.devices_changed),
                          estimated_s=cost.estimated_s, bytes_from_checkpoint=cost.bytes_from_checkpoint,
                          transfers=[transfer_to_wire(t, new.architecture.num_layers) for t in cost.transfers])
    return new.model_copy(update={"parent_plan_id": old.plan_id, "migration": migration})


def _mixed() -> Plan:
    """tp 2, pp 2, dp 2 with replica 0's first stage and replica 1's last split over 2 CP ranks instead of TP."""
    plan = _estimate({"tp": 2, "pp": 2, "dp": 2})
    split = {"tp": 1, "cp": 2}
    first, second = plan.replicas
    first = first.model_copy(update={"stages": [first.stages[0].model_copy(update=split), first.stages[1]]})
    second = second.model_copy(update={"stages": [second.stages[0], second.stages[1].model_copy(update=split)]})
    return plan.model_copy(update={"replicas": [first, second]})


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    return {
        "tp-cp": _estimate({"tp": 2, "cp": 2, "pp": 1, "dp": 2}),
        "interleaved": _estimate({"tp": 1, "cp": 2, "pp": 2, "dp": 2, "schedule": "interleaved", "virtual_stages": 2}),
        "mixed": _mixed(),
        "whole": _estimate({"tp": 2, "pp": 2, "dp": 2}),
    }


@pytest.fixture(scope="module")
def runs(plans, tmp_path_factory) -> dict[str, Case]:
    tmp = tmp_path_factory.mktemp("context-parallel")
    cases = [
        Case("tp-cp", plans["tp-cp"].model_dump_json(),
             executor_run.Options(steps=ADAM_STEPS, lr=ADAM_LR, optimizer="adam"), str(tmp / "tp-cp")),
        Case("interleaved", plans["interleaved"].model_dump_json(), executor_run.Options(steps=STEPS, lr=LR),
             str(tmp / "interleaved")),
        Case("mixed", plans["mixed"].model_dump_json(), executor_run.Options(steps=STEPS, lr=LR), str(tmp / "mixed")),
        # Whole sequences over 2 pipeline stages, then one stage splitting them over 2 CP ranks, then back: weights
        # and ZeRO-1 Adam state moved by the migration model's transfers each way.
        Case("switch", plans["whole"].model_dump_json(),
             executor_run.Options(steps=SWITCH_STEPS, lr=ADAM_LR, optimizer="adam"), str(tmp / "switch"),
             reconfigure=((SWITCHES[0], _moved_to(plans["whole"], plans["tp-cp"]).model_dump_json()),
                          (SWITCHES[1], _moved_to(plans["tp-cp"], plans["whole"]).model_dump_json()))),
    ]
    run_world(cases, max(used_devices(plan) for plan in plans.values()), tmp)
    return {case.name: case for case in cases}


def test_the_plans_are_what_the_tests_claim(plans):
    shapes = {name: [[(stage.tp, stage.cp, len(stage.devices)) for stage in replica.stages]
                     for replica in plan.replicas] for name, plan in plans.items()}
    assert shapes["tp-cp"] == [[(2, 2, 4)], [(2, 2, 4)]] and plans["tp-cp"].zero_stage == 1
    assert shapes["interleaved"] == [[(1, 2, 2), (1, 2, 2)]] * 2 and plans["interleaved"].virtual_stages == 2
    assert shapes["mixed"] == [[(1, 2, 2), (2, 1, 2)], [(2, 1, 2), (1, 2, 2)]]
    assert executor_model.model_config(plans["mixed"]).seq_len % 4 == 0
    assert shapes["whole"] == [[(2, 1, 2), (2, 1, 2)]] * 2


def test_a_stage_s_ranks_are_tp_groups_one_per_cp_rank(plans):
    """Megatron's rank order: TP rank fastest, then CP rank. The CP group of a TP rank holds the same heads."""
    stage = executor_layout.build_layout(plans["tp-cp"]).replicas[1].stages[0]
    assert (stage.tp, stage.cp, stage.ranks) == (2, 2, [4, 5, 6, 7])
    assert [stage.tp_ranks(c) for c in (0, 1)] == [[4, 5], [6, 7]]
    assert [stage.cp_ranks(t) for t in (0, 1)] == [[4, 6], [5, 7]]
    assert [stage.place_of(rank) for rank in stage.ranks] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_sequences_split_into_load_balanced_causal_pieces():
    """2 cp pieces of 16 tokens over cp 2: rank 0 holds the first and last quarter, rank 1 the middle two."""
    ranks = [executor_model.ContextParallel(None, c, 2) for c in (0, 1)]
    assert [rank.positions(16).tolist() for rank in ranks] == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    three = [executor_model.ContextParallel(None, c, 3).positions(12).tolist() for c in range(3)]
    assert three == [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]
    cfg = executor_model.ModelConfig(2, 8, 16, 2, 2, 32, True, seq_len=10)
    with pytest.raises(ValueError, match="4 equal pieces; 10 tokens.*--seq"):
        executor_model.Chunk(cfg, range(2), True, True, 0, executor_model.ContextParallel(None, 0, 2))


def test_a_tensor_and_context_parallel_plan_trains_like_one_process_with_sharded_adam(plans, runs):
    plan = plans["tp-cp"]
    ref_losses, _, ref_final = executor_model.reference_train(
        executor_model.model_config(plan), plan.global_batch_size, ADAM_STEPS, 0, ADAM_LR, "adam")
    got = losses(runs["tp-cp"].out_dir)
    assert len(got) == ADAM_STEPS
    for step, (a, b) in enumerate(zip(got, ref_losses, strict=True)):
        assert abs(a - b) <= ADAM_LOSS_TOLERANCE, f"step {step}: loss {a} != reference {b}"
    states = replica_states(runs["tp-cp"].out_dir)
    assert sorted(states) == [0, 1]
    for replica, state in states.items():
        problems = mismatches(state, ref_final, ADAM_PARAM_TOLERANCE)
        assert not problems, f"replica {replica}: " + "; ".join(problems)


def test_an_interleaved_context_parallel_pipeline_trains_like_one_process(plans, runs):
    _assert_trains_like_one_process(plans["interleaved"], runs["interleaved"].out_dir)


def test_stages_with_and_without_context_parallelism_train_like_one_process(plans, runs):
    _assert_trains_like_one_process(plans["mixed"], runs["mixed"].out_dir)


def test_switching_to_and_from_context_parallelism_moves_the_state_and_trains_like_one_process(plans, runs):
    """2 replicas of tp 2 x pp 2, then (step 2) of tp 2 x cp 2 in one stage, then (step 4) back: each switch moves
    exactly the transfers the service's migration model lists (each GPU of a CP stage holds every layer's TP
    slice, and its ZeRO-1 Adam share over 2 replicas x 2 CP ranks)."""
    def moved(old: str, new: str) -> set[str]:
        return {state for t in _moved_to(plans[old], plans[new]).migration.transfers for state in t.state}

    # Into CP every GPU needs the other stage's layers; back, it already holds them and only Adam shards move.
    assert moved("whole", "tp-cp") == {"weights", "optimizer"} and moved("tp-cp", "whole") == {"optimizer"}
    ref_losses, _, ref_final = executor_model.reference_train(
        executor_model.model_config(plans["whole"]), plans["whole"].global_batch_size, SWITCH_STEPS, 0, ADAM_LR,
        "adam")
    got = losses(runs["switch"].out_dir)
    assert len(got) == SWITCH_STEPS
    for step, (a, b) in enumerate(zip(got, ref_losses, strict=True)):
        assert abs(a - b) <= ADAM_LOSS_TOLERANCE, f"step {step}: loss {a} != reference {b}"
    for replica, state in replica_states(runs["switch"].out_dir).items():
        problems = mismatches(state, ref_final, ADAM_PARAM_TOLERANCE)
        assert not problems, f"replica {replica}: " + "; ".join(problems)
