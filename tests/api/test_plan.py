"""POST /v1/plan: model and GPU forms, failed and slow devices, stock (uniform) layouts."""

from __future__ import annotations

import pytest

from tests.api.support import small_request, stage_devices, verify_plan
from wire.schemas import Plan

LLAMA_HF_CONFIG = {
    "_name_or_path": "tiny-llama",
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

ARCHITECTURE = {
    "num_layers": 8,
    "hidden_size": 1024,
    "ffn_hidden_size": 2816,
    "num_attention_heads": 16,
    "num_kv_heads": 4,
    "vocab_size": 32000,
    "swiglu": True,
    "tied_embeddings": False,
}


def post_plan(client, body) -> Plan:
    response = client.post("/v1/plan", json=body)
    assert response.status_code == 200, response.text
    return verify_plan(response.json(), body)


def test_small_preset_plan(client):
    # A limit far above the fraction of a second this takes: the search finishes (whether it proves its
    # answer in the reported number is the bound's business: tests/invariants.py checks the report).
    body = small_request(options={"time_limit_s": 60})
    plan = post_plan(client, body)
    assert plan.model == "llama2-7b"
    assert plan.excluded_devices == []
    assert plan.solver.bound_ms <= plan.solver.objective_ms
    # The same request with stock layouts only is searched for its reported time and proven.
    stock = post_plan(client, small_request(options={"time_limit_s": 60, "allow_non_uniform": False}))
    assert stock.status == "optimal" and stock.solver.status == "OPTIMAL" and stock.solver.gap == 0.0
    assert plan.predicted.iteration_time_s <= stock.predicted.iteration_time_s * (1 + 1e-6)
    assert plan.solver.bound_ms <= stock.solver.objective_ms * (1 + 1e-6)
    tokens = body["training"]["global_batch_size"] * body["training"]["seq_length"]
    assert plan.predicted.tokens_per_s == pytest.approx(tokens / plan.predicted.iteration_time_s, rel=1e-3)
    assert 0 < plan.predicted.mfu < 1


def test_custom_gpu_object(client):
    gpu = {"name": "MyAccel", "peak_tflops": 400, "memory_gib": 96}
    body = small_request(cluster={"num_nodes": 1, "gpus_per_node": 8, "gpu": gpu})
    plan = post_plan(client, body)
    assert all(stage.memory_gib <= 96 for replica in plan.replicas for stage in replica.stages)


def test_custom_gpu_peak_flops_bounds_iteration_time(client):
    """The same request on a GPU with half the FLOP/s can not be faster (invariant 7 uses the custom peak)."""
    fast = post_plan(client, small_request(cluster={"num_nodes": 1, "gpus_per_node": 8,
                                                    "gpu": {"name": "fast", "peak_tflops": 400, "memory_gib": 80}}))
    slow = post_plan(client, small_request(cluster={"num_nodes": 1, "gpus_per_node": 8,
                                                    "gpu": {"name": "slow", "peak_tflops": 200, "memory_gib": 80}}))
    assert slow.predicted.iteration_time_s > fast.predicted.iteration_time_s


def test_architecture_object(client):
    body = small_request(model={**ARCHITECTURE, "name": "tiny-arch"})
    plan = post_plan(client, body)
    assert plan.model == "tiny-arch"
    assert all(replica.stages[-1].layers[1] == 8 for replica in plan.replicas)


def test_hf_config(client):
    body = small_request(model={"hf_config": LLAMA_HF_CONFIG})
    plan = post_plan(client, body)
    assert plan.model == "tiny-llama"
    assert all(replica.stages[-1].layers[1] == 8 for replica in plan.replicas)


def test_hf_config_and_architecture_agree(client):
    """The same architecture given both ways predicts the same iteration time."""
    body = {"training": {"global_batch_size": 16, "seq_length": 2048}, "options": {"time_limit_s": 2},
            "cluster": {"num_nodes": 1, "gpus_per_node": 8, "gpu": "A100-80GB"}}
    from_hf = post_plan(client, {**body, "model": {"hf_config": LLAMA_HF_CONFIG}})
    from_arch = post_plan(client, {**body, "model": ARCHITECTURE})
    assert abs(from_hf.predicted.iteration_time_s - from_arch.predicted.iteration_time_s) < 1e-9


def test_failed_whole_node_is_excluded(client):
    body = small_request(failures={"failed": ["1:*"]})
    plan = post_plan(client, body)
    node1 = {f"1:{g}" for g in range(8)}
    assert set(plan.excluded_devices) == node1
    assert len(plan.excluded_devices) == 8
    assert not node1 & set(stage_devices(plan))
    assert not node1 & set(plan.unused_devices)


def test_failed_device_is_excluded_and_never_used(client):
    body = small_request(failures={"failed": ["0:3"]})
    plan = post_plan(client, body)
    assert plan.excluded_devices == ["0:3"]
    assert "0:3" not in stage_devices(plan)
    assert "0:3" not in plan.unused_devices


def test_duplicate_and_overlapping_failures_are_listed_once(client):
    body = small_request(failures={"failed": ["0:3", "0:3", "0:*"]})
    plan = post_plan(client, body)
    assert sorted(plan.excluded_devices) == [f"0:{g}" for g in range(8)]


def test_slow_devices_report_their_speed(client):
    """Every GPU of the only node is slow, so the plan must use slow ones; each stage reports its slowest member."""
    speeds = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]
    slow = [{"device": f"0:{g}", "speed": s} for g, s in enumerate(speeds)]
    body = small_request(cluster={"num_nodes": 1, "gpus_per_node": 8, "gpu": "A100-80GB"},
                         failures={"slow": slow}, training={"global_batch_size": 16, "seq_length": 2048})
    plan = post_plan(client, body)  # checks stage.speed == min(member speeds)
    used_speeds = {stage.speed for replica in plan.replicas for stage in replica.stages}
    assert used_speeds and used_speeds <= set(speeds), used_speeds  # each is some member's speed
    assert any(speed < 1.0 for speed in used_speeds), "plan uses only 0:0 yet must report slow members"


def test_slow_devices_slow_the_plan_down(client):
    healthy = post_plan(client, small_request(cluster={"num_nodes": 1, "gpus_per_node": 8, "gpu": "A100-80GB"}))
    all_slow = [{"device": f"0:{g}", "speed": 0.5} for g in range(8)]
    slowed = post_plan(client, small_request(cluster={"num_nodes": 1, "gpus_per_node": 8, "gpu": "A100-80GB"},
                                             failures={"slow": all_slow}))
    assert all(stage.speed == 0.5 for replica in slowed.replicas for stage in replica.stages)
    assert slowed.predicted.iteration_time_s > 1.5 * healthy.predicted.iteration_time_s


def test_failed_device_listed_as_slow_is_still_excluded(client):
    body = small_request(failures={"failed": ["0:3"], "slow": [{"device": "0:3", "speed": 0.5}]})
    plan = post_plan(client, body)
    assert plan.excluded_devices == ["0:3"]
    assert "0:3" not in stage_devices(plan)


def test_speed_one_is_accepted(client):
    body = small_request(failures={"slow": [{"device": "0:1", "speed": 1.0}]})
    post_plan(client, body)


def test_stock_layouts_only_gives_equal_middle_stages(client):
    """allow_non_uniform false: a layout stock frameworks run (equal middle stages, identical replicas)."""
    body = small_request(
        model="qwen2.5-32b",
        failures={"failed": ["0:3"], "slow": [{"device": "1:2", "speed": 0.5}]},
        training={"global_batch_size": 64, "seq_length": 4096},
        options={"time_limit_s": 2, "allow_non_uniform": False},
    )
    plan = post_plan(client, body)
    assert plan.uniform is True
    first = plan.replicas[0]
    for replica in plan.replicas:
        assert [s.tp for s in replica.stages] == [s.tp for s in first.stages]
        assert [s.layers for s in replica.stages] == [s.layers for s in first.stages]
        assert replica.num_microbatches == first.num_microbatches
        middle = [stage.layers[1] - stage.layers[0] for stage in replica.stages[1:-1]]
        assert len(set(middle)) <= 1, f"middle stages differ: {middle}"
        assert len({stage.tp for stage in replica.stages}) == 1


def test_plan_is_deterministic(client):
    # A budget the solve never needs: determinism is about the seed, not about a race with the clock
    # on a loaded machine (this solve takes ~1 s alone).
    body = small_request(failures={"failed": ["0:3"]}, options={"time_limit_s": 30})
    first = post_plan(client, body)
    second = post_plan(client, body)
    # The checking searches are sized in counted work: the proof, not only the plan, repeats.
    assert (first.solver.status, first.solver.bound_ms, first.solver.stopped_by) == (
        second.solver.status, second.solver.bound_ms, second.solver.stopped_by)
    assert first.model_dump(exclude={"plan_id", "solver"}) == second.model_dump(exclude={"plan_id", "solver"})


def test_options_schedules_restricts_the_pipeline_schedule(client):
    body = small_request(
        cluster={"num_nodes": 2, "gpus_per_node": 8, "gpu": "A100-40GB"},
        model="llama2-13b",
        training={"global_batch_size": 16, "seq_length": 4096, "micro_batch_size": 1, "recompute": "full"},
        failures={"slow": [{"device": "0:0", "speed": 0.5}]},
        options={"time_limit_s": 2, "schedules": ["1f1b"]},
    )
    response = client.post("/v1/plan", json=body)
    assert response.status_code == 200, response.text
    plan = verify_plan(response.json(), body)
    # 1F1B runs one model chunk per stage, so the search may not interleave.
    assert plan.schedule == "1f1b" and plan.virtual_stages == 1
    assert set(plan.pipeline_schedule.candidates_ms) == {"1f1b"}
    assert all(entry.schedule == "1f1b" for entry in plan.pipeline_schedule.replicas)


def test_options_schedules_rejects_unknown_names(client):
    body = small_request(options={"schedules": ["pipedream"]})
    response = client.post("/v1/plan", json=body)
    assert response.status_code == 422
    assert "schedules" in str(response.json()["detail"])
