"""Every schedule the planner returns (handcrafted or CP-SAT) loads through PyTorch's own pipelining validation."""

from __future__ import annotations

import pytest

from adapters.torch_csv import render
from api.tasks.planning import plan_for
from tests.adapters.support import torch_load
from tests.api.support import small_request
from wire.schemas import PlanRequest

SCENARIOS = {
    # A half-speed GPU in a small cluster: the CP-SAT schedule wins (I/W split).
    "slow-gpu": small_request(failures={"failed": ["0:3"], "slow": [{"device": "1:1", "speed": 0.5}]}),
    # Stock layouts only: 1F1B or interleaved, what Megatron-LM runs.
    "stock": small_request(
        cluster={"num_nodes": 2, "gpus_per_node": 8, "gpu": "A100-40GB"},
        model="llama2-13b",
        training={"global_batch_size": 16, "seq_length": 4096, "micro_batch_size": 1, "recompute": "full"},
        options={"time_limit_s": 2, "allow_non_uniform": False},
    ),
    "zero-bubble-only": small_request(
        cluster={"num_nodes": 2, "gpus_per_node": 8, "gpu": "A100-40GB"},
        model="llama2-13b",
        training={"global_batch_size": 16, "seq_length": 4096, "micro_batch_size": 1, "recompute": "full"},
        options={"time_limit_s": 2, "schedules": ["zb-h1", "zb-h2"]},
    ),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_planned_replica_schedule_loads_in_pytorch(name, tmp_path):
    plan = plan_for(PlanRequest.model_validate(SCENARIOS[name]))
    assert plan.pipeline_schedule is not None
    v = plan.virtual_stages
    for entry in plan.pipeline_schedule.replicas:
        replica = next(r for r in plan.replicas if r.id == entry.replica_ids[0])
        p, m = len(replica.stages), replica.num_microbatches
        loaded = torch_load(render(plan, replica.id), tmp_path, p, v, m)
        assert len(loaded.pipeline_order) == p
    if name == "stock":
        assert plan.schedule in {"gpipe", "1f1b", "interleaved"}
    if name == "zero-bubble-only":
        assert plan.schedule in {"zb-h1", "zb-h2"}
