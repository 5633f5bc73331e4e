"""Mixture-of-experts models over the wire: planned with expert parallelism, estimated with `layout.ep`,
refused in the user's terms where EP cannot exist."""

from __future__ import annotations

import pytest

from cost_models.expert_parallel import layer_params_per_gpu
from tests.api.support import assert_detail, verify_plan
from wire.convert import resolve_model
from wire.schemas import PlanRequest

GIB = 2**30
# Mixtral-8x7B's published shape (config.json): 8 experts of width 14336, top-2
MIXTRAL = {"name": "mixtral-8x7b", "num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 14336,
           "num_attention_heads": 32, "num_kv_heads": 8, "vocab_size": 32000, "num_experts": 8,
           "experts_per_token": 2, "rope_theta": 1e6}
CLUSTER = {"num_nodes": 8, "gpus_per_node": 8, "gpu": "H100-SXM"}
TRAINING = {"global_batch_size": 256, "seq_length": 4096}


def _estimate(client, layout: dict, slow: list | None = None, model: dict | str = MIXTRAL):
    body = {"cluster": CLUSTER, "model": model, "training": TRAINING, "layout": layout,
            "failures": {"slow": slow or []}}
    return client.post("/v1/estimate", json=body), body


def test_mixtral_on_64_h100s_is_planned_with_expert_parallelism(client):
    request = {"cluster": CLUSTER, "model": MIXTRAL, "training": TRAINING, "options": {"time_limit_s": 10}}
    response = client.post("/v1/plan", json=request)
    assert response.status_code == 200, response.text
    plan = verify_plan(response.json(), request)
    assert plan.ep > 2 and len(plan.replicas) % plan.ep == 0  # > 2: so the limit below binds
    assert plan.predicted.breakdown.ep_comm_s > 0
    # every stage holds its share of all eight experts: at least their bf16 weights and fp32 gradients
    model = resolve_model(PlanRequest.model_validate(request).model)
    for replica in plan.replicas:
        for stage in replica.stages:
            layers = stage.layers[1] - stage.layers[0]
            held = layers * layer_params_per_gpu(model, stage.tp, plan.ep, plan.etp) * (2 + 4)
            assert stage.static_memory_gib * GIB >= held


def test_splitting_the_experts_frees_their_memory(client):
    """tp 2, pp 4, dp 8 with and without EP 8: each GPU of the EP plan holds 1 of 8 experts per layer and
    saves the weights and gradients of the 7 others (8 layers a stage, 3 x 4096 x 14336 weights each,
    halved by TP). Nothing else changes: the experts' Adam state is the same either way (8 experts sharded
    over 8 replicas, or one over one), and the replicated weights' stays sharded over all 8 replicas
    (Megatron's DDP keeps their gradient buffer over the data-parallel group, the experts' over the expert
    data-parallel group: megatron/core/distributed/distributed_data_parallel.py)."""
    layout = {"tp": 2, "pp": 4, "dp": 8, "recompute": "full"}
    whole, _ = _estimate(client, layout)
    split, body = _estimate(client, {**layout, "ep": 8})
    assert whole.status_code == 200 and split.status_code == 200, (whole.text, split.text)
    verify_plan(split.json(), body)
    assert split.json()["ep"] == 8 and whole.json()["ep"] == 1
    saved = whole.json()["replicas"][0]["stages"][1]["static_memory_gib"] - split.json()["replicas"][0]["stages"][1]["static_memory_gib"]
    expected = 8 * 7 * 3 * 4096 * 14336 / 2 * (2 + 4)
    assert saved * GIB == pytest.approx(expected, rel=0.01)
    # and pays for it in all-to-all traffic
    assert split.json()["predicted"]["breakdown"]["ep_comm_s"] > 0 == whole.json()["predicted"]["breakdown"]["ep_comm_s"]


@pytest.mark.parametrize("ep", [2, 8])
def test_a_slow_gpu_paces_its_whole_expert_parallel_group(client, ep):
    """Replicas sharing experts exchange tokens at every layer: one slow GPU slows the same stage of every
    replica of its EP group, and no other replica."""
    response, body = _estimate(client, {"tp": 2, "pp": 4, "dp": 8, "ep": ep, "recompute": "full"},
                               slow=[{"device": "5:3", "speed": 0.5}])
    assert response.status_code == 200, response.text
    plan = verify_plan(response.json(), body)
    paced = [r.id for r in sorted(plan.replicas, key=lambda r: r.id) if any(s.speed < 1 for s in r.stages)]
    assert len(paced) == ep and paced[0] % ep == 0 and paced == list(range(paced[0], paced[0] + ep))
    slow_positions = {i for r in plan.replicas for i, s in enumerate(r.stages) if s.speed < 1}
    assert len(slow_positions) == 1


def test_expert_parallelism_is_refused_where_it_cannot_exist(client):
    response, _ = _estimate(client, {"tp": 2, "pp": 4, "dp": 8, "ep": 2}, model="llama2-7b")
    assert_detail(response, "ep 2 needs a mixture-of-experts model")
    response, _ = _estimate(client, {"tp": 2, "pp": 4, "dp": 6, "ep": 3})
    assert_detail(response, "ep 3 must divide the 8 routed experts")
    response, _ = _estimate(client, {"tp": 2, "pp": 4, "dp": 8, "ep": 16})
    assert_detail(response, "ep 16 must divide")
    # expert-TP: a divisor of tp, EP groups of whole TP groups, whole replicas
    response, _ = _estimate(client, {"tp": 2, "pp": 4, "dp": 8, "ep": 2, "etp": 4})
    assert_detail(response, "etp 4 must divide tp 2")
    response, _ = _estimate(client, {"tp": 4, "pp": 2, "dp": 8, "ep": 2, "etp": 1})
    assert_detail(response, "ep 2 must be a multiple of tp / etp = 4")
    response, _ = _estimate(client, {"tp": 2, "pp": 4, "dp": 6, "ep": 8, "etp": 1})
    assert_detail(response, "ep 8 with etp 1 spans 4 replicas (ep x etp / tp), which must divide the 6 replicas")
    response, _ = _estimate(client, {"tp": 2, "pp": 4, "dp": 8, "etp": 1}, model="llama2-7b")
    assert_detail(response, "needs a mixture-of-experts model")


def test_max_expert_parallel_bounds_the_search(client):
    """Unbounded, this request splits the experts over more than 2 replicas (above)."""
    request = {"cluster": CLUSTER, "model": MIXTRAL, "training": TRAINING,
               "options": {"time_limit_s": 10, "max_expert_parallel": 2}}
    response = client.post("/v1/plan", json=request)
    assert response.status_code == 200, response.text
    assert verify_plan(response.json(), request).ep <= 2


def test_the_flex_dispatcher_sends_fewer_bytes_across_nodes_and_the_plan_says_which_it_priced(client):
    """EP 16 over two nodes: DeepEP/HybridEP's dispatch (one network copy per remote node) prices the all-to-all
    below Megatron's all-to-all dispatcher (one per remote expert); the plan echoes the dispatcher."""
    layout = {"tp": 1, "pp": 4, "dp": 16, "ep": 16, "recompute": "full"}
    answers = {}
    for dispatcher in ("alltoall", "flex"):
        body = {"cluster": CLUSTER, "model": {**MIXTRAL, "num_experts": 16}, "layout": layout,
                "training": {**TRAINING, "moe_dispatcher": dispatcher}}
        response = client.post("/v1/estimate", json=body)
        assert response.status_code == 200, response.text
        verify_plan(response.json(), body)
        answers[dispatcher] = response.json()
        assert answers[dispatcher]["moe_dispatcher"] == dispatcher
    comm = {d: a["predicted"]["breakdown"]["ep_comm_s"] for d, a in answers.items()}
    assert 0 < comm["flex"] < comm["alltoall"]
    dense = client.post("/v1/estimate", json={"cluster": CLUSTER, "model": "llama3-8b", "training": TRAINING,
                                              "layout": {"tp": 1, "pp": 1, "dp": 64}})
    assert dense.status_code == 200 and dense.json()["moe_dispatcher"] is None


def test_whole_experts_beside_tp_estimate_faster_at_the_same_memory(client):
    """Qwen3-30B-A3B (top-8) at tp 2: experts split over TP gather 8 routed copies of every token over the TP
    group and scatter them back; whole experts (etp 1, ep over both TP ranks of the same 4 replicas) do not,
    and each GPU holds the same expert weights."""
    cluster = {"num_nodes": 4, "gpus_per_node": 8, "gpu": "H100-SXM"}
    answers = {}
    for name, layout in (("split", {"tp": 2, "pp": 1, "ep": 4}), ("whole", {"tp": 2, "pp": 1, "ep": 8, "etp": 1})):
        body = {"cluster": cluster, "model": "qwen3-30b-a3b", "training": TRAINING,
                "layout": {**layout, "recompute": "full"}}
        response = client.post("/v1/estimate", json=body)
        assert response.status_code == 200, response.text
        answers[name] = verify_plan(response.json(), body)
    split, whole = answers["split"], answers["whole"]
    assert (split.etp, whole.etp, whole.ep) == (None, 1, 8)
    memory = [max(s.memory_gib for r in plan.replicas for s in r.stages) for plan in (split, whole)]
    assert memory[0] == pytest.approx(memory[1], rel=1e-3)
    assert whole.predicted.iteration_time_s < 0.9 * split.predicted.iteration_time_s


def test_the_ep_overlap_hides_all_to_alls_on_the_layouts_megatron_runs_it_on(client):
    """training.moe_a2a_overlap: an interleaved EP layout pays less all-to-all and says so; a non-interleaved
    pipeline (which megatron-core refuses the overlap on) pays the same as without it."""
    def estimate(layout: dict, overlap: bool):
        body = {"cluster": CLUSTER, "model": MIXTRAL, "layout": {**layout, "recompute": "selective"},
                "training": {**TRAINING, "moe_a2a_overlap": overlap}}
        response = client.post("/v1/estimate", json=body)
        assert response.status_code == 200, response.text
        return verify_plan(response.json(), body)

    interleaved = {"tp": 2, "pp": 4, "virtual_stages": 2, "schedule": "interleaved", "ep": 4}
    plain, overlapped = estimate(interleaved, False), estimate(interleaved, True)
    assert (plain.moe_a2a_overlap, overlapped.moe_a2a_overlap) == (False, True)
    assert overlapped.predicted.breakdown.ep_comm_s < 0.5 * plain.predicted.breakdown.ep_comm_s
    assert overlapped.predicted.iteration_time_s < plain.predicted.iteration_time_s
    one_chunk = {"tp": 2, "pp": 4, "ep": 4}
    plain, asked = estimate(one_chunk, False), estimate(one_chunk, True)
    assert asked.moe_a2a_overlap is False
    assert asked.predicted.iteration_time_s == plain.predicted.iteration_time_s
