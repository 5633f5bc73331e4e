"""Context parallelism in failure-aware (non-uniform) plans: a damaged cluster's replicas may split sequences.

Issue 19's worst retention case is two whole sequences per GPU: after a loss some replica must take more than two
per GPU, and with one GPU per replica that is 1.5x the work. Replicas of cp 2 x pp 3 take 13 sequences on 6 GPUs
(2.17 each), and the failure-aware search, whose outer choices now include cp, finds them.
"""

from __future__ import annotations

from collections import Counter

from api.tasks.planning import estimate_for, plan_for
from cost_models.iteration import exposed_dp_sync_ms, stage_time
from cost_models.layout import ParallelShape
from cost_models.stage_costs import stage_cost_terms
from planner.nonuniform.partitions import StageType
from planner.nonuniform.templates import OuterChoice, TermsCache, template_costs
from tests.api.support import verify_plan
from tests.planner.helpers import small_problem
from wire.schemas import EstimateRequest, PlanRequest


def _lost_gpu_request(max_context_parallel: int) -> dict:
    """32 A100s, llama2-7b at 4,096 tokens, two sequences per GPU, GPU 0 of node 1 lost."""
    return {"cluster": {"num_nodes": 4, "gpus_per_node": 8, "gpu": "A100-80GB"}, "model": "llama2-7b",
            "training": {"global_batch_size": 64, "seq_length": 4096}, "failures": {"failed": ["1:0"]},
            "options": {"time_limit_s": 10, "max_context_parallel": max_context_parallel}}


def test_a_lost_gpu_at_two_sequences_per_gpu_is_planned_with_context_parallel_replicas():
    body = _lost_gpu_request(2)
    plan = verify_plan(plan_for(PlanRequest.model_validate(body)).model_dump(mode="json"), body)
    without = plan_for(PlanRequest.model_validate(_lost_gpu_request(1)))
    assert not plan.uniform  # 64 sequences over the replicas the 31 GPUs hold: unequal counts
    assert {stage.cp for replica in plan.replicas for stage in replica.stages} == {2}
    # 2.00 s against 2.09 s when each stage must hold whole sequences (tp 2 x pp 3 replicas then)
    assert plan.predicted.iteration_time_s < 0.97 * without.predicted.iteration_time_s


def test_its_stages_cost_what_an_estimate_of_the_same_shape_prices():
    """The non-uniform search prices stages through its own caches; `/v1/estimate` prices a uniform layout of
    the same stages (equal counts, as it requires with cp) through the uniform model: each stage's forward and
    backward must agree."""
    body = _lost_gpu_request(2)
    plan = plan_for(PlanRequest.model_validate(body))
    replica = max(plan.replicas, key=lambda r: r.num_microbatches)
    layout = {"tp": replica.stages[0].tp, "cp": 2, "pp": len(replica.stages), "dp": len(plan.replicas),
              "micro_batch_size": plan.micro_batch_size, "recompute": plan.recompute, "schedule": "1f1b",
              "layers_per_stage": [stage.layers[1] - stage.layers[0] for stage in replica.stages]}
    estimate_body = {**body, "training": {"global_batch_size": replica.num_microbatches * len(plan.replicas)
                                          * plan.micro_batch_size, "seq_length": 4096}, "layout": layout}
    estimate = estimate_for(EstimateRequest.model_validate(estimate_body))
    mine = [(s.forward_ms, s.backward_ms) for s in replica.stages]
    theirs = [(s.forward_ms, s.backward_ms) for s in estimate.replicas[0].stages]
    assert mine == theirs


def test_a_templates_gradient_sync_spans_every_cp_rank():
    """Every CP rank holds the stage's weights, so gradients reduce over replicas x cp ranks: a template of two
    replicas at cp 2 syncs as a uniform shape of dp 2, cp 2 does (`exposed_dp_sync_ms`), more than over 2."""
    problem = small_problem(num_nodes=2, seq_length=16384, global_batch=8)
    outer = OuterChoice(tp=1, pp=2, micro_batch_size=1, recompute="full", virtual_stages=1, cp=2)
    replicas = 2  # 8 GPUs in replicas of 2 stages x 2 CP ranks
    cache = TermsCache(problem, outer, replicas, replicas, job_devices=8)
    base = StageType(1, 1.0)
    template = template_costs(problem, cache, (base, base), (3, 3), base, replicas)
    terms = stage_cost_terms(problem.workload, problem.hardware, ParallelShape(1, 2, replicas, 1, "full", cp=2),
                             problem.efficiency, problem.software)
    uniform = max(exposed_dp_sync_ms(terms, stage_time(terms, i, 3)) for i in range(2))
    assert template.sync_uniform_ms == uniform
    # The comparison tells the two apart: the all-reduce over 4 ranks moves 1.5x what it does over 2.
    params = stage_time(terms, 0, 3).params
    assert terms.dp_sync_ms(params, 4) > 1.2 * terms.dp_sync_ms(params, 2)


def test_a_damaged_node_forms_cp_groups_of_its_survivors():
    """On the node that lost a GPU, cp 2 groups pair up to six of its seven survivors, each in one stage."""
    body = _lost_gpu_request(2)
    plan = plan_for(PlanRequest.model_validate(body))
    on_node_1 = Counter(device for replica in plan.replicas for stage in replica.stages for device in stage.devices
                        if device.startswith("1:"))
    assert "1:0" not in on_node_1 and all(count == 1 for count in on_node_1.values())
    assert len(on_node_1) % 2 == 0 and len(on_node_1) <= 6
