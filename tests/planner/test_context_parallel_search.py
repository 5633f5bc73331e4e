"""Context parallelism in the search: which CP sizes it tries, where their groups go, and what it picks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from api.tasks.planning import estimate_for, plan_for
from planner.errors import PlanningError
from planner.uniform.candidates import context_parallel_sizes, uniform_floor_ms
from tests.api.support import small_request
from wire.convert import to_problem
from wire.schemas import EstimateRequest, PlanRequest

H100_NODES = {"gpus_per_node": 8, "gpu": "H100-SXM"}


def _request(nodes: int, model: str, batch: int, seq: int, **options) -> PlanRequest:
    return PlanRequest.model_validate({
        "cluster": {"num_nodes": nodes, **H100_NODES}, "model": model,
        "training": {"global_batch_size": batch, "seq_length": seq},
        "options": {"allow_non_uniform": False, "time_limit_s": 10, **options}})


def test_a_128k_llama3_405b_on_1024_h100s_is_planned_with_context_parallelism():
    """Issue 19: Meta trained the 128k phase with CP 16. Without CP only pipelines of one or two layers a stage
    hold the activations, at a fraction of the speed."""
    plan = plan_for(_request(128, "llama3-405b", 64, 131072))
    cps = {stage.cp for replica in plan.replicas for stage in replica.stages}
    assert len(cps) == 1 and cps.pop() > 1
    without = plan_for(_request(128, "llama3-405b", 64, 131072, max_context_parallel=1))
    assert {stage.cp for replica in without.replicas for stage in replica.stages} == {1}
    assert plan.predicted.iteration_time_s < without.predicted.iteration_time_s


def test_max_context_parallel_1_keeps_every_stage_whole():
    plan = plan_for(_request(2, "llama3-8b", 8, 65536, max_context_parallel=1))
    assert {stage.cp for replica in plan.replicas for stage in replica.stages} == {1}
    with_cp = plan_for(_request(2, "llama3-8b", 8, 65536))
    assert max(stage.cp for stage in with_cp.replicas[0].stages) > 1
    assert with_cp.predicted.iteration_time_s < plan.predicted.iteration_time_s


def test_cp_sizes_cut_the_sequence_evenly_and_groups_fit_a_node_or_whole_nodes():
    problem = to_problem(_request(4, "llama3-8b", 8, 24576))  # 24576 = 2^13 x 3
    sizes = context_parallel_sizes(problem, 2)
    assert all(24576 % (2 * cp * 2) == 0 for cp in sizes)
    assert 3 in sizes and 5 not in sizes
    # tp 2: cp 4 fills a node; cp 8 and 16 take 2 and 4 whole nodes; cp 3 stays inside a node (6 of 8 GPUs)
    assert {1, 2, 3, 4, 8, 16} <= set(sizes) and 6 not in sizes  # 12 GPUs is neither
    # a TP size that does not divide a node never spans nodes
    assert all(3 * cp <= 8 for cp in context_parallel_sizes(problem, 3))
    assert context_parallel_sizes(replace(problem, software=replace(problem.software, flash_attention=False)), 2) == [1]
    assert context_parallel_sizes(replace(problem, max_context_parallel=1), 2) == [1]


def test_the_uniform_floor_stays_below_a_context_parallel_plan():
    """`uniform_floor_ms` bounds every uniform layout with the cp = 1 terms alone (its docstring's argument):
    a plan that uses CP must not beat it."""
    request = _request(2, "llama3-8b", 8, 65536)
    plan = plan_for(request)
    assert max(stage.cp for stage in plan.replicas[0].stages) > 1
    assert uniform_floor_ms(to_problem(request)) <= 1e3 * plan.predicted.iteration_time_s


def test_a_context_parallel_group_spanning_nodes_takes_whole_healthy_nodes():
    request = _request(4, "llama3-8b", 4, 131072)
    plan = plan_for(request)
    stage = plan.replicas[0].stages[0]
    nodes = [device.split(":")[0] for device in stage.devices]
    assert stage.tp * stage.cp == len(stage.devices) > 8
    assert all(nodes.count(node) == 8 for node in set(nodes))
    # a damaged node never joins one
    damaged = PlanRequest.model_validate({**request.model_dump(), "failures": {"failed": ["1:3"]}})
    for replica in plan_for(damaged).replicas:
        for stage in replica.stages:
            if len(stage.devices) > 8:
                assert not any(device.startswith("1:") for device in stage.devices)


@pytest.mark.parametrize("layout,message", [
    ({"tp": 2, "cp": 3, "pp": 1}, "does not divide by 12"),
    ({"tp": 4, "cp": 3, "pp": 1, "seq": 49152}, "fits in one node or spans whole nodes"),
    ({"tp": 3, "cp": 8, "pp": 1}, "fits in one node or spans whole nodes"),
])
def test_an_impossible_cp_layout_is_refused_in_the_users_terms(layout, message):
    layout = dict(layout)
    body = small_request(cluster={"num_nodes": 4, **H100_NODES}, model="llama3-8b",
                         training={"global_batch_size": 8, "seq_length": layout.pop("seq", 16384)})
    if layout["tp"] == 3:  # a model whose heads tp 3 divides
        body["model"] = {"num_layers": 4, "hidden_size": 1536, "ffn_hidden_size": 4096, "num_attention_heads": 12,
                         "num_kv_heads": 12, "vocab_size": 32000}
        body["training"]["seq_length"] = 3 * 16384
    with pytest.raises(PlanningError, match=message):
        estimate_for(EstimateRequest.model_validate({**body, "layout": layout}))


@pytest.mark.parametrize("failures", [{}, {"slow": [{"device": "0:1", "speed": 0.6}]}])
def test_cp_over_whole_microbatches_loses_to_splitting_them_over_replicas(failures):
    """The search leaves out cp dividing the micro-batch size (`split_sequences_win`): the same GPUs as cp x
    more replicas of mbs / cp sequences do at least as well, slow GPUs included."""
    body = small_request(cluster={"num_nodes": 2, **H100_NODES}, model="llama3-8b", failures=failures,
                         training={"global_batch_size": 16, "seq_length": 16384})
    with_cp = {"tp": 2, "cp": 2, "pp": 2, "dp": 2, "micro_batch_size": 2, "recompute": "full"}
    split = {"tp": 2, "cp": 1, "pp": 2, "dp": 4, "micro_batch_size": 1, "recompute": "full"}
    cp_plan, split_plan = (estimate_for(EstimateRequest.model_validate({**body, "layout": layout}))
                           for layout in (with_cp, split))
    assert split_plan.predicted.iteration_time_s <= cp_plan.predicted.iteration_time_s
    if failures:
        return
    # healthy: the same devices, in the same rank order (with slow GPUs the estimate places each its own way)
    assert [d for s in range(2) for r in cp_plan.replicas for d in r.stages[s].devices] == [
        d for s in range(2) for r in split_plan.replicas for d in r.stages[s].devices]


def test_a_cp_plans_replicas_sent_back_to_estimate_are_refused_not_mispriced():
    """A CP stage's devices are tp x cp GPUs; read replica by replica they would pass for one TP group of that
    size, a different layout. The estimate says to give it by shape."""
    plan = plan_for(_request(2, "llama3-8b", 8, 65536))
    assert max(stage.cp for stage in plan.replicas[0].stages) > 1
    replicas = [{"num_microbatches": r.num_microbatches,
                 "stages": [{"devices": s.devices, "layers": list(s.layers), "cp": s.cp} for s in r.stages]}
                for r in plan.replicas]
    body = {**_request(2, "llama3-8b", 8, 65536).model_dump(), "layout": {"replicas": replicas}}
    with pytest.raises(PlanningError, match="context parallelism .* by shape only"):
        estimate_for(EstimateRequest.model_validate(body))
