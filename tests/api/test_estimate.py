"""POST /v1/estimate: one fixed layout, no search."""

from __future__ import annotations

import pytest

from tests.api.support import (
    assert_detail,
    assert_validation,
    estimate_request,
    stage_devices,
    verify_plan,
)


def post_estimate(client, body):
    response = client.post("/v1/estimate", json=body)
    assert response.status_code == 200, response.text
    return verify_plan(response.json(), body)


def test_tp2_pp2_layout_is_reflected_exactly(client):
    body = estimate_request({"tp": 2, "pp": 2, "micro_batch_size": 1, "virtual_stages": 1,
                             "schedule": "1f1b", "recompute": "selective"})
    plan = post_estimate(client, body)
    assert plan.uniform is True
    assert plan.micro_batch_size == 1
    assert plan.schedule == "1f1b"
    assert plan.virtual_stages == 1
    assert plan.recompute == "selective"
    # 32 healthy GPUs / (tp 2 x pp 2) = 8 replicas, 256 / 8 = 32 microbatches each.
    assert len(plan.replicas) == 8
    assert plan.unused_devices == [] and plan.excluded_devices == []
    for replica in plan.replicas:
        assert replica.num_microbatches == 32
        assert [stage.tp for stage in replica.stages] == [2, 2]
        assert [tuple(stage.layers) for stage in replica.stages] == [(0, 16), (16, 32)]


def test_explicit_dp_leaves_the_rest_unused(client):
    body = estimate_request({"tp": 2, "pp": 2, "dp": 2})
    plan = post_estimate(client, body)
    assert len(plan.replicas) == 2
    assert all(replica.num_microbatches == 128 for replica in plan.replicas)
    assert len(stage_devices(plan)) == 8
    assert len(plan.unused_devices) == 24


def test_uneven_layers_per_stage_is_accepted(client):
    body = estimate_request({"tp": 2, "pp": 2, "layers_per_stage": [10, 22]})
    plan = post_estimate(client, body)
    for replica in plan.replicas:
        assert [tuple(stage.layers) for stage in replica.stages] == [(0, 10), (10, 32)]
    first = plan.replicas[0].stages
    assert first[1].forward_ms > first[0].forward_ms  # 22 layers take longer than 10


def test_uneven_pp_with_layers_per_stage(client):
    body = estimate_request({"tp": 2, "pp": 3, "layers_per_stage": [10, 11, 11]})
    plan = post_estimate(client, body)
    assert [tuple(s.layers) for s in plan.replicas[0].stages] == [(0, 10), (10, 21), (21, 32)]


def test_interleaved_schedule(client):
    body = estimate_request({"tp": 2, "pp": 2, "schedule": "interleaved", "virtual_stages": 2})
    plan = post_estimate(client, body)
    assert plan.schedule == "interleaved"
    assert plan.virtual_stages == 2


CHUNKED = {"tp": 1, "pp": 4, "schedule": "interleaved", "virtual_stages": 2, "recompute": "selective"}


def test_uneven_model_chunks_are_timed_as_given(client):
    """llama2-7b's 32 layers over 4 stages of 2 chunks (chunk c of stage s at c x 4 + s): 8 layers a stage
    either way, but chunks of 3 where the embedding and the head run (Megatron-Bridge's split) pipeline faster
    than equal chunks, and chunks of 5 there slower: the timeline runs each chunk's own work."""
    light_ends = post_estimate(client, estimate_request({**CHUNKED, "layers_per_chunk": [3, 4, 4, 5, 5, 4, 4, 3]}))
    even = post_estimate(client, estimate_request(CHUNKED))
    heavy_ends = post_estimate(client, estimate_request({**CHUNKED, "layers_per_chunk": [5, 4, 4, 3, 3, 4, 4, 5]}))
    assert [s.chunk_layers for s in light_ends.replicas[0].stages] == [[3, 5], [4, 4], [4, 4], [5, 3]]
    assert all(s.chunk_layers is None for s in even.replicas[0].stages)
    assert [s.layers for s in light_ends.replicas[0].stages] == [s.layers for s in even.replicas[0].stages]
    times = [plan.predicted.iteration_time_s for plan in (light_ends, even, heavy_ends)]
    assert times[0] < times[1] < times[2], times
    # Stage 0's forwards: chunk 0 (3 layers and the embedding) and chunk 1 (5 layers) add up to the stage's, in
    # about their layers' proportion (the embedding is a lookup).
    stage = light_ends.pipeline_schedule.replicas[0].stages[0]
    duration = {op: end - start for op, start, end in zip(stage.ops, stage.start_ms, stage.end_ms)}
    first, second = duration["F0"], duration["F0.1"]
    assert first + second == pytest.approx(light_ends.replicas[0].stages[0].forward_ms, abs=2e-3)
    assert 3 / 5 < first / second < 3.3 / 5


def test_megatron_bridges_llama31_405b_recipe_is_estimated_as_it_runs(client):
    """The published H100 recipe (1,024 GPUs, tp 8, cp 2, pp 8, vp 8, FP8, bf16 gradients, its 126 layers split
    with the embedding and the loss counted as layers): a 422 before estimates took uneven chunks."""
    body = {"cluster": {"num_nodes": 128, "gpus_per_node": 8, "gpu": "H100-SXM"}, "model": "llama3-405b",
            "training": {"global_batch_size": 1536, "seq_length": 8192, "precision": "fp8", "grad_precision": "bf16"},
            "layout": {"tp": 8, "cp": 2, "pp": 8, "virtual_stages": 8, "schedule": "interleaved", "recompute": "none",
                       "micro_batch_size": 1, "layers_per_chunk": [1] + [2] * 62 + [1]}}
    plan = post_estimate(client, body)
    stages = plan.replicas[0].stages
    assert stages[0].chunk_layers == [1] + [2] * 7 and stages[-1].chunk_layers == [2] * 7 + [1]
    assert [s.layers[1] - s.layers[0] for s in stages] == [15] + [16] * 6 + [15]
    assert max(s.memory_gib for s in stages) <= 80 - 3  # under the default memory reserve
    assert plan.replicas[0].num_microbatches == 1536 // 8


def test_uneven_model_chunks_that_cannot_exist_are_422(client):
    def refused(layout: dict, *words: str) -> None:
        assert_detail(client.post("/v1/estimate", json=estimate_request(layout)), *words)

    refused({**CHUNKED, "layers_per_chunk": [4] * 7}, "layers_per_chunk", "4 x 2 = 8", "num_layers=32")
    refused({**CHUNKED, "layers_per_chunk": [1] * 5000}, "of 5000 counts", "4 x 2 = 8")  # not echoed whole
    refused({**CHUNKED, "layers_per_chunk": []}, "4 x 2 = 8")
    refused({**CHUNKED, "layers_per_chunk": [0, 4, 4, 8, 4, 4, 4, 4]}, "positive")
    refused({**CHUNKED, "layers_per_chunk": [3, 4, 4, 5, 5, 4, 4, 4]}, "summing to num_layers=32")
    refused({"tp": 1, "pp": 4, "layers_per_chunk": [8, 8, 8, 8]}, "virtual_stages >= 2")
    refused({**CHUNKED, "layers_per_chunk": [3, 4, 4, 5, 5, 4, 4, 3], "layers_per_stage": [9, 8, 8, 7]},
            "disagrees", "[8, 8, 8, 8]")
    refused({**CHUNKED, "pp": 3}, "does not divide num_layers 32", "layers_per_chunk")
    refused({**CHUNKED, "layers_per_stage": [9, 8, 8, 7]}, "layers_per_chunk")


def test_estimate_excludes_failed_devices(client):
    body = estimate_request({"tp": 2, "pp": 2}, failures={"failed": ["0:3", "3:*"], "slow": [{"device": "1:0", "speed": 0.5}]})
    plan = post_estimate(client, body)
    # 23 healthy GPUs hold 11 TP groups of 2, so 5 replicas of 2 stages (dp omitted: all of them, not the 4 that
    # would split 256 evenly), taking 256 microbatches as 52 + 4 x 51.
    assert sorted(r.num_microbatches for r in plan.replicas) == [51] * 4 + [52]
    used = set(stage_devices(plan))
    assert "0:3" not in used and not any(device.startswith("3:") for device in used)
    assert len(plan.excluded_devices) == 9


def test_tp_not_dividing_heads(client):
    response = client.post("/v1/estimate", json=estimate_request({"tp": 3, "pp": 2}))
    assert_detail(response, "tp 3", "32 attention heads")


def test_tp_larger_than_a_node(client):
    response = client.post("/v1/estimate", json=estimate_request({"tp": 16, "pp": 1}))
    assert_detail(response, "tp 16", "gpus_per_node 8")


def test_pp_not_dividing_layers(client):
    response = client.post("/v1/estimate", json=estimate_request({"tp": 2, "pp": 3}))
    assert_detail(response, "pp 3", "num_layers 32", "layers_per_stage")


def test_pp_exceeding_layers(client):
    response = client.post("/v1/estimate", json=estimate_request({"tp": 1, "pp": 64}))
    assert_detail(response, "pp 64", "32 layers")


def test_layers_per_stage_not_summing(client):
    response = client.post("/v1/estimate", json=estimate_request({"tp": 2, "pp": 2, "layers_per_stage": [10, 20]}))
    assert_detail(response, "[10, 20]", "num_layers=32")


def test_layers_per_stage_wrong_length(client):
    response = client.post("/v1/estimate", json=estimate_request({"tp": 2, "pp": 2, "layers_per_stage": [32]}))
    assert_detail(response, "[32]", "pp=2")


def test_layers_per_stage_with_an_empty_stage(client):
    response = client.post("/v1/estimate", json=estimate_request({"tp": 2, "pp": 2, "layers_per_stage": [0, 32]}))
    assert_detail(response, "[0, 32]", "positive")


def test_layout_that_does_not_fit_memory(client):
    layout = {"tp": 1, "pp": 1, "dp": 16, "micro_batch_size": 16, "recompute": "none"}
    response = client.post("/v1/estimate", json=estimate_request(layout))
    detail = assert_detail(response, "GiB", "A100-80GB", "77 GiB", "3 GiB memory reserve")
    assert "stage 0" in detail


def test_interleaved_with_one_virtual_stage(client):
    layout = {"tp": 2, "pp": 2, "schedule": "interleaved", "virtual_stages": 1}
    response = client.post("/v1/estimate", json=estimate_request(layout))
    assert_detail(response, "interleaved", "virtual_stages")


def test_1f1b_with_virtual_stages(client):
    response = client.post("/v1/estimate", json=estimate_request({"tp": 2, "pp": 2, "virtual_stages": 2}))
    assert_detail(response, "1f1b", "virtual_stages")


def test_global_batch_not_divisible_by_dp_times_micro_batch(client):
    """Stock layouts only: equal counts or a 422 with the numbers and the choices that work."""
    body = estimate_request({"tp": 2, "pp": 2, "dp": 3}, options={"time_limit_s": 2, "allow_non_uniform": False})
    detail = assert_detail(client.post("/v1/estimate", json=body),
                           "global_batch_size 256", "256 microbatches", "dp 3", "micro_batch_size 1")
    # Divisors of 256 nearest 3 (at most the 8 replicas the cluster holds), multiples of 3 x 1 around 256.
    assert "dp 1, 2 or 4" in detail and "255 or 258" in detail and "allow_non_uniform: true" in detail
    assert "with dp 3" not in detail, "no micro-batch size splits 256 over 3 replicas"


def test_unequal_microbatches_where_allowed(client):
    """With unequal counts allowed (the default), dp 3 is estimated as given: 256 = 86 + 85 + 85, and the
    answer says so."""
    plan = post_estimate(client, estimate_request({"tp": 2, "pp": 2, "dp": 3}))
    assert sorted(r.num_microbatches for r in plan.replicas) == [85, 85, 86]
    assert plan.uniform is False
    assert any("1 replica 86, 2 replicas 85" in note for note in plan.solver.notes), plan.solver.notes


def test_micro_batch_not_dividing_global_batch(client):
    response = client.post("/v1/estimate", json=estimate_request({"tp": 2, "pp": 2, "micro_batch_size": 3}))
    detail = assert_detail(response, "global_batch_size 256", "micro_batch_size 3")
    assert "micro_batch_size 1, 2 or 4, or a global_batch_size of 255 or 258" in detail


# Issue 21: 8 nodes x 4 A100-40GB, a 24-layer model, batch 1000 at micro-batch 8, tp 4, pp 1, dp omitted.
_ISSUE_MODEL = {"num_layers": 24, "hidden_size": 2048, "ffn_hidden_size": 8192, "num_attention_heads": 16,
                "num_kv_heads": 16, "vocab_size": 32000}


def _issue_request(**options) -> dict:
    return {"cluster": {"num_nodes": 8, "gpus_per_node": 4, "gpu": "A100-40GB"}, "model": _ISSUE_MODEL,
            "training": {"global_batch_size": 1000, "seq_length": 2048},
            "options": {"time_limit_s": 2, **options}, "layout": {"tp": 4, "pp": 1, "micro_batch_size": 8}}


def test_omitted_dp_means_every_healthy_device_not_fewer_replicas(client):
    """Before, this answered with 5 replicas, 12 GPUs unused and `status: optimal`, saying nothing."""
    body = _issue_request()
    plan = post_estimate(client, body)
    assert len(plan.replicas) == 8 and plan.unused_devices == []
    assert sorted(r.num_microbatches for r in plan.replicas) == [15] * 3 + [16] * 5
    assert plan.status == "fixed" and plan.solver.status == "FIXED"
    assert any("125 microbatches" in note for note in plan.solver.notes)


def test_omitted_dp_with_stock_layouts_only_is_a_422_with_alternatives(client):
    body = _issue_request(allow_non_uniform=False)
    detail = assert_detail(client.post("/v1/estimate", json=body), "125 microbatches", "8 replicas",
                           "dp 1 or 5", "960 or 1024", "micro_batch_size 1, 5 or 25")
    assert "dp omitted" in detail


def test_contradicting_micro_batch_sizes(client):
    body = estimate_request({"tp": 2, "pp": 2, "micro_batch_size": 8},
                            training={"global_batch_size": 256, "seq_length": 4096, "micro_batch_size": 2})
    assert_detail(client.post("/v1/estimate", json=body), "training.micro_batch_size 2 vs layout.micro_batch_size 8")


def test_contradicting_recompute(client):
    body = estimate_request({"tp": 2, "pp": 2, "recompute": "none"},
                            training={"global_batch_size": 256, "seq_length": 4096, "recompute": "full"})
    assert_detail(client.post("/v1/estimate", json=body), "training.recompute full vs layout.recompute none")


def test_a_setting_given_once_applies(client):
    """The training section's micro-batch size and recompute apply when the layout leaves them out (before,
    the layout's defaults, 1 and selective, silently won)."""
    body = estimate_request({"tp": 2, "pp": 2},
                            training={"global_batch_size": 256, "seq_length": 4096, "micro_batch_size": 2,
                                      "recompute": "full"})
    plan = post_estimate(client, body)
    assert (plan.micro_batch_size, plan.recompute) == (2, "full")
    assert {r.num_microbatches for r in plan.replicas} == {16}


def test_dp_larger_than_the_cluster(client):
    response = client.post("/v1/estimate", json=estimate_request({"tp": 2, "pp": 2, "dp": 16}))
    assert_detail(response, "dp 16", "the cluster has 16")


def test_all_failed_estimate(client):
    failed = [f"{n}:*" for n in range(4)]
    response = client.post("/v1/estimate", json=estimate_request({"tp": 2, "pp": 2}, failures={"failed": failed}))
    assert_detail(response, "the cluster has 0")


def test_estimate_needs_a_layout(client):
    body = estimate_request({"tp": 2, "pp": 2})
    del body["layout"]
    assert_validation(client.post("/v1/estimate", json=body), ("layout",), "Field required")


def test_layout_recompute_auto_is_rejected(client):
    response = client.post("/v1/estimate", json=estimate_request({"tp": 2, "pp": 2, "recompute": "auto"}))
    assert_validation(response, ("layout", "recompute"), "selective")


def test_layout_unknown_field(client):
    response = client.post("/v1/estimate", json=estimate_request({"tp": 2, "pp": 2, "dpp": 2}))
    assert_validation(response, ("layout", "dpp"), "Extra inputs are not permitted")


def test_flash_attention_2_costs_time_where_attention_dominates_and_is_refused_on_ampere(client):
    """training.attention_kernel fa2 prices FlashAttention-2 on an H100: at 2k tokens attention is a small part of
    a layer and the iteration barely moves; at 64k over cp 8 it dominates and the iteration approaches the kernel
    ratio (1.6x). On an A100 FlashAttention-2 is the fused kernel: asking for fa2 there is a 422 that says so."""
    h100 = {"num_nodes": 1, "gpus_per_node": 8, "gpu": "H100-SXM"}

    def seconds(kernel: str, seq: int, cp: int) -> float:
        body = estimate_request({"tp": 1, "cp": cp, "pp": 1, "recompute": "full"}, cluster=h100, model="llama3-8b",
                                training={"global_batch_size": 8 // cp, "seq_length": seq, "zero_stage": 3,
                                          "attention_kernel": kernel})
        return post_estimate(client, body).predicted.iteration_time_s

    short = seconds("fa2", 2048, 1) / seconds("fused", 2048, 1)
    long = seconds("fa2", 65536, 8) / seconds("fused", 65536, 8)
    assert 1.0 < short < 1.1
    assert short + 0.2 < long < 1.6
    a100 = estimate_request({"tp": 1, "pp": 1}, training={"global_batch_size": 256, "seq_length": 4096,
                                                          "attention_kernel": "fa2"})
    assert_detail(client.post("/v1/estimate", json=a100), "FlashAttention-2 is the fused kernel")
