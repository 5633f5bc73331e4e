"""GPT-OSS over the wire: its config read as-is, its sliding windows priced and kept out of context
parallelism, its exports built by torchtitan's own GPT-OSS code or refused by name."""

from __future__ import annotations

import dataclasses

import torch
from torchtitan.config import ConfigManager

from adapters import megatron
from adapters.registry import ExportError
from adapters.torchtitan import model_selection, override_argv
from cost_models.model_spec import model_preset
from tests.api.support import assert_detail, verify_plan
from tests.cost_models.test_model_spec import GPT_OSS_120B_CONFIG
from wire.schemas import Plan

CLUSTER = {"num_nodes": 2, "gpus_per_node": 8, "gpu": "H100-SXM"}
LONG = {"global_batch_size": 16, "seq_length": 32768}


def test_a_long_context_plan_keeps_windowed_attention_out_of_context_parallelism(client):
    """At 32k tokens the search tries CP for a dense model (it starts at 16,384): not with sliding windows, whose
    keys a CP ring would exchange in vain (the ring is not priced for them)."""
    request = {"cluster": CLUSTER, "model": "gpt-oss-20b", "training": LONG,
               "options": {"time_limit_s": 5, "max_context_parallel": 4, "allow_non_uniform": False}}
    response = client.post("/v1/plan", json=request)
    assert response.status_code == 200, response.text
    plan = verify_plan(response.json(), request)
    assert {stage.cp for replica in plan.replicas for stage in replica.stages} == {1}
    dense = {**request, "model": {**dataclasses.asdict(model_preset("gpt-oss-20b")), "sliding_window": None,
                                  "full_attention_every": 1, "rope_scaling": None}}
    windowless = client.post("/v1/plan", json=dense)
    assert windowless.status_code == 200, windowless.text
    # every layer attending to all 32k tokens costs more than half of them doing so
    assert windowless.json()["predicted"]["iteration_time_s"] > plan.predicted.iteration_time_s


def test_an_estimate_with_cp_on_sliding_windows_is_a_422(client):
    body = {"cluster": CLUSTER, "model": "gpt-oss-20b", "training": LONG, "layout": {"tp": 1, "cp": 2, "pp": 2}}
    response = client.post("/v1/estimate", json=body)
    assert_detail(response, "sliding-window attention (window 128)", "plan it with cp 1")


def test_the_gpt_oss_config_plans_and_exports_to_torchtitans_own_model(client):
    twenty_b = {**GPT_OSS_120B_CONFIG, "num_local_experts": 32, "num_hidden_layers": 24,
                "layer_types": ["sliding_attention", "full_attention"] * 12}
    request = {"cluster": CLUSTER, "model": {"hf_config": twenty_b},
               "training": {"global_batch_size": 32, "seq_length": 4096},
               "layout": {"tp": 1, "pp": 2, "ep": 8}}
    response = client.post("/v1/estimate", json=request)
    assert response.status_code == 200, response.text
    plan = Plan.model_validate(response.json())
    arch = plan.architecture
    assert (arch.attention_sinks, arch.linear_bias, arch.sliding_window, arch.full_attention_every) == (True, True, 128, 2)
    assert arch.rope_scaling.rope_type == "yarn"
    # gpt-oss-20b's shape: torchtitan's own gpt_oss_20b config builds it, with the plan's expert parallelism
    assert model_selection(plan.model_copy(update={"architecture": arch.model_copy(update={"name": "x"})})) == (
        "gpt_oss", "gpt_oss_20b")
    parsed = ConfigManager().parse_args(["--module", "gpt_oss", "--config", "gpt_oss_20b", *override_argv(plan)])
    assert parsed.parallelism.expert_parallel_degree == 8
    with torch.device("meta"):
        built = parsed.model_spec.model.build()
    assert sum(p.numel() for p in built.parameters()) == model_preset("gpt-oss-20b").total_params


def test_megatron_export_names_what_it_does_not_emit(client):
    request = {"cluster": CLUSTER, "model": "gpt-oss-20b", "training": {"global_batch_size": 32, "seq_length": 4096},
               "layout": {"tp": 1, "pp": 2, "ep": 8}}
    plan = Plan.model_validate(client.post("/v1/estimate", json=request).json())
    try:
        megatron.megatron_args(plan)
    except ExportError as refused:
        text = str(refused)
    else:
        raise AssertionError("the Megatron-LM export built GPT-OSS without its YaRN scaling and expert biases")
    # sinks and windows it emits (tests/adapters/test_model_exports.py); these two it cannot
    for feature in ("YaRN RoPE scaling", "biases on the router and experts", "no flag for YaRN"):
        assert feature in text
    assert "attention sinks" not in text and "sliding-window" not in text


def test_the_search_tries_no_context_parallelism_on_sliding_windows():
    from planner.uniform.candidates import context_parallel_sizes
    from wire.convert import to_problem
    from wire.schemas import PlanRequest

    request = {"cluster": CLUSTER, "model": "gpt-oss-20b", "training": LONG, "options": {"max_context_parallel": 4}}
    windowed = to_problem(PlanRequest.model_validate(request))
    arch = {**dataclasses.asdict(model_preset("gpt-oss-20b")), "sliding_window": None, "full_attention_every": 1}
    windowless = to_problem(PlanRequest.model_validate({**request, "model": arch}))
    assert context_parallel_sizes(windowed, 1) == [1]
    assert context_parallel_sizes(windowless, 1) == [1, 2, 4]
