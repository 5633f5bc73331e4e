"""Hybrid sharding (HSDP) through the wire: ZeRO state sharded over `dp_shard` replicas and replicated across the
groups; searched for ZeRO-2/3 (a node's replicas), estimated for any divisor, refused in the user's terms."""

from __future__ import annotations

import pytest

from api.tasks.comparing import compare_for
from api.tasks.planning import estimate_for, plan_for
from cost_models.model_spec import model_preset
from planner.errors import PlanningError
from planner.replan.holdings import device_holdings, placed_layout
from tests.api.support import assert_detail, estimate_request, small_request, verify_plan
from wire.schemas import EstimateRequest, PlanRequest

GIB = 2**30
# One 200 Gb/s NIC per GPU (Google Cloud's A3 nodes), where a node's 8 replicas sharing the state beat all 32: at
# DGX H100's 400 Gb/s the planner shards ZeRO-2 over all 32.
H100_32 = {"num_nodes": 4, "gpus_per_node": 8, "gpu": "H100-SXM", "inter_node_bandwidth_gb_s": 25.0}
TRAINING = {"global_batch_size": 64, "seq_length": 8192}


def _plan_request(zero, **options):
    return small_request(cluster=H100_32, model="llama3-8b", training={**TRAINING, "zero_stage": zero},
                         options={"time_limit_s": 10, "allow_non_uniform": False, **options})


def _estimate(layout: dict, zero=3, **extra):
    body = estimate_request(layout, cluster=H100_32, model="llama3-8b", training={**TRAINING, "zero_stage": zero},
                            **extra)
    return estimate_for(EstimateRequest.model_validate(body))


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_2_and_3_shard_inside_a_node_where_that_is_faster_than_every_replica(zero):
    body = _plan_request(zero)
    plan = plan_for(PlanRequest.model_validate(body))
    verify_plan(plan.model_dump(mode="json"), body)
    stage = plan.replicas[0].stages[0]
    dp = len(plan.replicas)
    assert plan.status == "optimal"
    assert plan.dp_shard == 8 // (stage.tp * stage.cp) and plan.dp_shard < dp  # a node's replicas, replicated
    # its shard groups are whole nodes: replicas 0..s-1, s..2s-1, ... each on one node
    for first in range(0, dp, plan.dp_shard):
        nodes = {device.split(":")[0] for replica in plan.replicas[first:first + plan.dp_shard]
                 for device in replica.stages[0].devices}
        assert len(nodes) == 1
    # the same layout estimated with each shard group the search weighs: the plan is the faster one
    layout = {"tp": stage.tp, "cp": stage.cp, "pp": len(plan.replicas[0].stages), "dp": dp,
              "micro_batch_size": plan.micro_batch_size, "recompute": plan.recompute}
    hybrid, full = _estimate({**layout, "dp_shard": plan.dp_shard}, zero), _estimate(layout, zero)
    assert hybrid.predicted.iteration_time_s == pytest.approx(plan.predicted.iteration_time_s, rel=1e-6)
    assert full.predicted.iteration_time_s > hybrid.predicted.iteration_time_s
    assert full.predicted.breakdown.dp_comm_s > hybrid.predicted.breakdown.dp_comm_s
    assert full.dp_shard == dp


def test_hybrid_sharding_holds_the_groups_share_of_the_state():
    """18 bytes a parameter (bf16 weight, fp32 gradient, fp32 master and two moments) over 8 instead of 32."""
    layout = {"tp": 1, "pp": 1, "dp": 32}
    full, hybrid = _estimate(layout), _estimate({**layout, "dp_shard": 8})
    params = model_preset("llama3-8b").total_params
    added_gib = (hybrid.replicas[0].stages[0].memory_gib - full.replicas[0].stages[0].memory_gib)
    assert added_gib == pytest.approx(params * 18 * (1 / 8 - 1 / 32) / GIB, abs=0.01)


def test_trainers_without_hybrid_sharding_can_say_so():
    plan = plan_for(PlanRequest.model_validate(_plan_request(3, allow_hybrid_sharding=False)))
    assert plan.dp_shard == len(plan.replicas)


@pytest.mark.parametrize("zero", [0, 1])
def test_below_zero_2_plans_shard_over_every_replica(zero):
    plan = plan_for(PlanRequest.model_validate(_plan_request(zero)))
    assert plan.dp_shard == (1 if zero == 0 else len(plan.replicas))


def test_non_uniform_plans_name_no_shard_group():
    body = small_request(failures={"slow": [{"device": "0:3", "speed": 0.4}]}, options={"time_limit_s": 5})
    plan = plan_for(PlanRequest.model_validate(body))
    assert not plan.uniform and plan.dp_shard is None


def test_zero_1_shard_groups_estimate_as_megatrons_partial_distributed_optimizer():
    """Estimated, not searched: sharding ZeRO-1 over fewer replicas holds more and sends no fewer bytes across
    nodes, so the search never gains by it; a user running it still gets its time and memory."""
    layout = {"tp": 1, "pp": 2, "dp": 16}
    full, hybrid = _estimate(layout, zero=1), _estimate({**layout, "dp_shard": 4}, zero=1)
    assert hybrid.dp_shard == 4
    assert hybrid.replicas[0].stages[0].memory_gib > full.replicas[0].stages[0].memory_gib
    assert hybrid.predicted.breakdown.dp_comm_s >= full.predicted.breakdown.dp_comm_s


@pytest.mark.parametrize("layout, zero, fragments", [
    ({"tp": 1, "pp": 1, "dp": 32, "dp_shard": 5}, 3, ("dp_shard 5 must divide the 32 replicas", "1, 2, 4, 8, 16, 32")),
    ({"tp": 1, "pp": 2, "dp": 16, "dp_shard": 4}, 0, ("dp_shard 4 shards nothing with zero_stage 0",)),
    ({"tp": 1, "pp": 1, "dp": 24, "dp_shard": 8}, 1, ("hybrid sharding (dp_shard 8) is estimated with equal "
                                                      "microbatch counts",)),
])
def test_shard_groups_that_cannot_exist_are_a_422_in_the_users_terms(client, layout, zero, fragments):
    body = estimate_request(layout, cluster=H100_32, model="llama3-8b", training={**TRAINING, "zero_stage": zero})
    assert_detail(client.post("/v1/estimate", json=body), *fragments)


def test_hybrid_sharding_with_expert_parallelism_shards_the_experts_inside_the_group(client):
    """ep 4 inside shard groups of 8 replicas: each expert block's state is sharded over the 2 replicas of the group
    holding it (torchtitan's efsdp, megatron-core's partial expert data-parallel group), against 8 when one group
    spans all 32 replicas, so the hybrid layout holds more."""
    layout = {"tp": 1, "pp": 1, "dp": 32, "ep": 4, "recompute": "full"}
    bodies = [estimate_request({**layout, **extra}, cluster=H100_32, model="qwen3-30b-a3b",
                               training={**TRAINING, "zero_stage": 3}) for extra in ({}, {"dp_shard": 8})]
    full, hybrid = (client.post("/v1/estimate", json=body) for body in bodies)
    assert full.status_code == hybrid.status_code == 200, hybrid.text
    assert hybrid.json()["dp_shard"] == 8 and hybrid.json()["ep"] == 4
    memory = [answer.json()["replicas"][0]["stages"][0]["memory_gib"] for answer in (full, hybrid)]
    assert memory[1] > memory[0]


def test_an_ep_group_straddling_shard_groups_is_a_422_naming_the_sizes_that_work(client):
    body = estimate_request({"tp": 1, "pp": 1, "dp": 32, "ep": 8, "dp_shard": 4}, cluster=H100_32,
                            model="qwen3-30b-a3b", training={**TRAINING, "zero_stage": 3})
    assert_detail(client.post("/v1/estimate", json=body), "hybrid sharding (dp_shard 4 of 32 replicas) with ep 8",
                  "spans 8 TP groups", "choose dp_shard 8, 16 or leave it out")


def test_a_replica_by_replica_layout_takes_no_dp_shard(client):
    body = estimate_request({"replicas": [{"num_microbatches": 4, "stages": [{"devices": ["0:0"], "layers": [0, 32]}]}],
                             "dp_shard": 1})
    assert_detail(client.post("/v1/estimate", json=body), "give either replicas or dp_shard")


def test_compare_weighs_a_node_shard_group_and_refuses_one_the_search_never_tries():
    searched = EstimateRequest.model_validate(estimate_request(
        {"tp": 1, "pp": 1, "dp": 32, "dp_shard": 8}, cluster=H100_32, model="llama3-8b",
        training={**TRAINING, "zero_stage": 3}))
    comparison = compare_for(searched)
    assert not comparison.planner_slower
    assert comparison.best.predicted.iteration_time_s <= comparison.yours.predicted.iteration_time_s
    outside = EstimateRequest.model_validate(estimate_request(
        {"tp": 1, "pp": 2, "dp": 16, "dp_shard": 4}, cluster=H100_32, model="llama3-8b",
        training={**TRAINING, "zero_stage": 1}))
    with pytest.raises(PlanningError, match="dp_shard 4 .hybrid sharding under zero_stage 1. is estimated but not "
                                            "searched"):
        compare_for(outside)


def test_replicas_of_different_shard_groups_hold_the_same_optimizer_shard():
    """Migration counts what each GPU holds: with shard groups of 4 replicas, replica r holds what r + 4 holds,
    and each group together holds every piece once."""
    plan = _estimate({"tp": 1, "pp": 2, "dp": 8, "dp_shard": 4}, zero=1)
    holdings = device_holdings(placed_layout(plan))
    for stage in range(2):
        held = [holdings[replica.stages[stage].devices[0]] for replica in plan.replicas]
        ranges = [{(b.first_unit, b.end_unit, b.optimizer_lo, b.optimizer_hi) for b in blocks} for blocks in held]
        assert ranges[:4] == ranges[4:]
        assert len(set(map(frozenset, ranges[:4]))) == 4
        for unit_blocks in zip(*(sorted(blocks, key=lambda b: (b.first_unit, b.optimizer_lo)) for blocks in held[:4])):
            covered = sum(b.optimizer_hi - b.optimizer_lo for b in unit_blocks)
            assert covered == pytest.approx(unit_blocks[0].weight_hi - unit_blocks[0].weight_lo)
