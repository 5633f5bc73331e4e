"""Expert parallelism against the exhaustive oracle (`tests/oracle/enumerator.py`: every stock layout,
every ep dividing the experts whose EP groups span whole replicas, each expert over its TP group or (etp 1)
on one GPU, estimated through `/v1/estimate`, sharing no code with the search).

The instances are the oracle's small healthy clusters with a mixture-of-experts model (4 or 8 experts,
top-1 or top-2, sometimes a shared expert) on GPUs small enough that where the experts sit decides what
fits, so the search must find the optimum over layouts with and without EP; the failure-aware plan of the
same request must be at least as fast.
"""

from __future__ import annotations

import random

import pytest

from tests.oracle.checks import check_plans_against
from tests.oracle.enumerator import instance, oracle_best

INSTANCES = 8
CP_INSTANCES = 3
SEED = 4244  # drawn so that the guards below hold under the cost model (4242 lost its EP-over-CP optimum when
# the experts got their own gradient-sync group, 2026-12-05)


def _instances() -> list[dict]:
    rng = random.Random(SEED)
    bodies = []
    for _ in range(INSTANCES):
        body = instance(rng)
        model = {**body["model"], "num_experts": rng.choice([4, 8]), "experts_per_token": rng.choice([1, 2]),
                 "ffn_hidden_size": body["model"]["hidden_size"] * 2}
        if rng.random() < 0.3:
            model["shared_expert_ffn_hidden_size"] = body["model"]["hidden_size"]
        bodies.append({**body, "model": model,
                       "training": {**body["training"], "global_batch_size": rng.choice([4, 8, 12, 16])}})
    # context parallelism searched beside EP: an EP group may take a replica's CP ranks
    for body in bodies[:CP_INSTANCES]:
        body["options"] = {**body["options"], "max_context_parallel": 2}
    return bodies


# Hybrid sharding with EP: 2 nodes of 4 H100s on a 12.5 GB/s network, ZeRO-3, a 4-layer model of 8 experts, whose
# optimum shards inside each node with each EP group of whole experts (etp 1) inside a shard group
HYBRID_EP = {"cluster": {"num_nodes": 2, "gpus_per_node": 4, "gpu": "H100-SXM", "inter_node_bandwidth_gb_s": 12.5},
             "model": {"num_layers": 4, "hidden_size": 1024, "ffn_hidden_size": 2048, "num_attention_heads": 8,
                       "num_kv_heads": 2, "vocab_size": 32000, "num_experts": 8, "experts_per_token": 2},
             "training": {"global_batch_size": 16, "seq_length": 4096, "zero_stage": 3},
             "options": {"allow_non_uniform": False}}


def test_hybrid_sharding_with_expert_parallelism_is_the_oracles_optimum_where_it_wins() -> None:
    best_s, layout = oracle_best(HYBRID_EP)
    assert layout is not None and layout.get("ep", 1) > 1 and layout.get("dp_shard") not in (None, layout["dp"])
    plan = check_plans_against(HYBRID_EP, best_s, layout)
    assert plan is not None and plan.ep > 1 and plan.dp_shard < len(plan.replicas)


@pytest.mark.parametrize("body", _instances(), ids=[f"instance-{i}" for i in range(INSTANCES)])
def test_the_stock_plan_of_a_mixture_of_experts_is_the_oracles_optimum(body: dict) -> None:
    plan = check_plans_against(body, *oracle_best(body))
    if plan is not None:
        stage = plan.replicas[0].stages[0]
        expert_replicas = max(1, plan.ep * (plan.etp or stage.tp) // (stage.tp * stage.cp))
        assert len(plan.replicas) % expert_replicas == 0 and body["model"]["num_experts"] % plan.ep == 0


def test_the_instances_exercise_expert_parallelism() -> None:
    """Guards what the instances were drawn for: in some of them the optimum splits the experts, in some it keeps
    them whole beside TP (etp 1), in some it splits them over CP ranks."""
    best = [oracle_best(body)[1] for body in _instances()]
    assert any(layout is not None and layout.get("ep", 1) > 1 for layout in best)
    assert any(layout is not None and layout.get("etp") == 1 for layout in best)
    assert any(layout is not None and layout.get("ep", 1) > 1 and layout.get("cp", 1) > 1 for layout in best)
