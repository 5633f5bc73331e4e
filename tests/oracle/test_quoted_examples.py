"""The layouts issue 16 quoted as beating "optimal" plans: the planner must now plan at least as fast.

Only the wire contract is used: a plan request, and `/v1/estimate` of the fully specified alternative
layout (the cost model applied to that one layout, no search). A planner whose space leaves the
alternative out (micro-batch sizes restricted to powers of two, say) fails here.
"""

from __future__ import annotations

import pytest

from api.tasks.planning import estimate_for, plan_for
from wire.schemas import EstimateRequest, PlanRequest

# Relative slack for float rounding of the wire's figures (they carry 6 significant digits).
SLACK = 1e-5

NARROW_MODEL = {"num_layers": 11, "hidden_size": 2560, "ffn_hidden_size": 6912, "num_attention_heads": 20,
                "vocab_size": 32000}


def _request(batch: int, *, nodes: int = 1, gpus: int = 8, gpu: str = "A100-40GB", **training) -> dict:
    return {"cluster": {"num_nodes": nodes, "gpus_per_node": gpus, "gpu": gpu}, "model": NARROW_MODEL,
            "training": {"global_batch_size": batch, "seq_length": 2048, **training}}


@pytest.mark.parametrize(("batch", "layout"), [
    # 20 sequences on 4 replicas: 5 each, one micro-batch of 5 (not a power of two).
    (20, {"tp": 2, "pp": 1, "dp": 4, "micro_batch_size": 5, "recompute": "none"}),
    # 12 sequences on 4 replicas: 3 each.
    (12, {"tp": 2, "pp": 1, "dp": 4, "micro_batch_size": 3, "recompute": "none"}),
])
def test_any_micro_batch_size_dividing_the_batch_is_searched(batch: int, layout: dict) -> None:
    request = _request(batch)
    plan = plan_for(PlanRequest.model_validate(request))
    alternative = estimate_for(EstimateRequest.model_validate({**request, "layout": layout}))
    assert plan.predicted.iteration_time_s <= alternative.predicted.iteration_time_s * (1 + SLACK), (
        f"plan (mbs {plan.micro_batch_size}) {plan.predicted.iteration_time_s} s is slower than "
        f"{layout} at {alternative.predicted.iteration_time_s} s"
    )
