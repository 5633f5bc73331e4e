"""A plan whose every replica is one pipeline stage runs one model chunk.

The non-uniform search's outer choices name chunks per stage for their nominal pipeline; replicas may be
shorter. When every replica of the answer is a single stage there is nothing to interleave, and no trainer
runs chunks without pipeline stages: such a plan once came back as `interleaved`, 8 virtual stages, pp 1,
which Megatron-LM was told as --num-virtual-stages-per-pipeline-rank 8 and torchtitan refused.
"""

from __future__ import annotations

from adapters.registry import export_format
from api.tasks.planning import plan_for
from wire.schemas import PlanRequest

REQUEST = {"cluster": {"num_nodes": 4, "gpus_per_node": 8, "gpu": "H100-SXM"}, "model": "llama3-8b",
           "training": {"global_batch_size": 64, "seq_length": 4096}}


def test_single_stage_replicas_run_one_chunk_and_every_trainer_takes_them():
    plan = plan_for(PlanRequest.model_validate(REQUEST))
    assert {len(replica.stages) for replica in plan.replicas} == {1}
    assert plan.virtual_stages == 1 and plan.schedule != "interleaved"
    megatron = export_format("megatron").render(plan)
    assert "--num-virtual-stages-per-pipeline-rank" not in megatron
    export_format("torchtitan").render(plan)  # raised "virtual_stages 8 without pipeline parallelism"
    # as fast as the stock plan of the same request, which never chunks a single stage
    stock = plan_for(PlanRequest.model_validate({**REQUEST, "options": {"allow_non_uniform": False}}))
    assert plan.predicted.iteration_time_s <= stock.predicted.iteration_time_s * (1 + 1e-6)


def test_a_request_allowing_chunked_schedules_only_keeps_its_chunks():
    """With only `interleaved` allowed there is no one-chunk schedule to report: the layout keeps its chunks
    (the request asked for them) rather than failing to schedule."""
    plan = plan_for(PlanRequest.model_validate({**REQUEST, "options": {"schedules": ["interleaved"]}}))
    assert plan.schedule == "interleaved" and plan.virtual_stages > 1
