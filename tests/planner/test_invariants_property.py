"""Property: every plan for a random cluster, model and failure set satisfies API.md's invariants,
and when none exists the error says why with numbers."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from api.tasks.planning import estimate_for, plan_for
from planner.errors import InfeasibleError, PlanningError
from tests.invariants import check_invariants
from wire.convert import resolve_hardware, resolve_model
from wire.schemas import EstimateRequest, PlanRequest

ARCHITECTURES = [
    {"num_layers": 4, "hidden_size": 256, "ffn_hidden_size": 688, "num_attention_heads": 8, "num_kv_heads": 2,
     "vocab_size": 1000, "swiglu": True, "tied_embeddings": False},
    {"num_layers": 6, "hidden_size": 384, "ffn_hidden_size": 1536, "num_attention_heads": 6, "num_kv_heads": 6,
     "vocab_size": 5000, "swiglu": False, "tied_embeddings": True},
    {"num_layers": 12, "hidden_size": 1024, "ffn_hidden_size": 2816, "num_attention_heads": 16, "num_kv_heads": 4,
     "vocab_size": 32000, "swiglu": True, "tied_embeddings": False},
]


@st.composite
def requests(draw):
    num_nodes = draw(st.integers(1, 4))
    gpus_per_node = draw(st.sampled_from([1, 2, 4, 8]))
    devices = [f"{n}:{g}" for n in range(num_nodes) for g in range(gpus_per_node)]
    failed = draw(st.lists(st.sampled_from(devices), max_size=3, unique=True))
    whole_nodes = draw(st.lists(st.integers(0, num_nodes - 1), max_size=1, unique=True))
    failed += [f"{n}:*" for n in whole_nodes]
    slow_devices = draw(st.lists(st.sampled_from(devices), max_size=3, unique=True))
    if draw(st.booleans()):
        # Every GPU of one node slow: a whole TP domain degraded.
        slow_devices = sorted(set(slow_devices) | {f"0:{g}" for g in range(gpus_per_node)})
    slow = [{"device": d, "speed": draw(st.sampled_from([0.25, 0.5, 0.7, 0.9]))} for d in slow_devices]
    # GPU memory from tiny to roomy, so some draws cannot fit at all.
    memory_gib = draw(st.sampled_from([2.05, 2.2, 3.0, 8.0, 80.0]))
    return {
        "cluster": {"num_nodes": num_nodes, "gpus_per_node": gpus_per_node,
                    "gpu": {"name": "test-gpu", "peak_tflops": 100.0, "memory_gib": memory_gib}},
        "failures": {"failed": failed, "slow": slow},
        "model": draw(st.sampled_from(ARCHITECTURES)),
        "training": {"global_batch_size": draw(st.sampled_from([1, 4, 6, 7, 16, 30])),
                     "seq_length": draw(st.sampled_from([128, 512, 2048])),
                     "micro_batch_size": draw(st.sampled_from([None, 1, 2])),
                     "zero_stage": draw(st.sampled_from([0, 1])),
                     "recompute": draw(st.sampled_from(["auto", "none", "full"]))},
        "options": {"time_limit_s": 5, "allow_non_uniform": draw(st.booleans())},
    }


@settings(max_examples=80)
@given(requests())
def test_every_plan_satisfies_the_invariants(raw):
    request = PlanRequest.model_validate(raw)
    try:
        plan = plan_for(request)
    except InfeasibleError as error:
        message = str(error)
        assert re.search(r"\d", message), f"infeasible without numbers: {message}"
        fitting = _a_memory_frugal_layout_that_runs(raw)
        assert fitting is None, f"the planner found no layout, yet {fitting} runs: {message}"
        return
    except PlanningError as error:
        message = str(error)
        assert "global_batch_size" in message and "micro_batch_size" in message, message
        return
    speeds = {s.device: s.speed for s in request.failures.slow}
    check_invariants(plan, request, resolve_model(request.model), resolve_hardware(request.cluster).gpu, speeds)
    if not request.options.allow_non_uniform:
        for replica in plan.replicas:
            middle = [s.layers[1] - s.layers[0] for s in replica.stages[1:-1]]
            assert len(set(middle)) <= 1


def _a_memory_frugal_layout_that_runs(raw: dict) -> dict | None:
    """A fixed layout `/v1/estimate` can run for this request, trying the ones that need the least memory
    per GPU (widest TP, longest pipelines, micro-batch 1, full recompute unless the request fixes it); None if
    none runs. The search
    claimed nothing fits: a layout that runs means it pruned a feasible one."""
    model, cluster = raw["model"], raw["cluster"]
    training = raw["training"]
    mbs = training.get("micro_batch_size") or 1
    # The request's recompute binds the planner (and an estimate must agree with it): full only where it is free.
    recompute = training.get("recompute") if training.get("recompute") not in (None, "auto") else "full"
    kv_heads = model["num_kv_heads"] or model["num_attention_heads"]
    tps = [t for t in range(cluster["gpus_per_node"], 0, -1) if kv_heads % t == 0 and model["num_attention_heads"] % t == 0]
    for tp in tps:
        for pp in range(model["num_layers"], 0, -1):
            layout = {"tp": tp, "pp": pp, "micro_batch_size": mbs, "schedule": "1f1b", "recompute": recompute,
                      "layers_per_stage": _even(model["num_layers"], pp)}
            try:
                estimate_for(EstimateRequest.model_validate({**raw, "layout": layout}))
            except PlanningError:
                continue
            return layout
    return None


def _even(layers: int, stages: int) -> list[int]:
    return [layers // stages + (1 if i < layers % stages else 0) for i in range(stages)]


def test_model_that_cannot_fit_reports_numbers():
    request = PlanRequest.model_validate({
        "cluster": {"num_nodes": 1, "gpus_per_node": 8, "gpu": "A100-80GB"},
        "model": "llama3-405b",
        "training": {"global_batch_size": 8, "seq_length": 4096},
    })
    try:
        plan_for(request)
    except InfeasibleError as error:
        message = str(error)
    else:
        raise AssertionError("llama3-405b cannot fit on 8 A100-80GB")
    # 405.9B parameters x 18 bytes = 7.3e12 bytes = 6.6 TiB; 8 x (80 - 3 reserved) GiB = 616 GiB.
    assert "6.6 TiB" in message and "616 GiB" in message and "8 surviving" in message


PIPELINED_MODEL = {"num_layers": 16, "hidden_size": 2048, "ffn_hidden_size": 5632, "num_attention_heads": 16,
                   "num_kv_heads": 4, "vocab_size": 32000, "swiglu": True, "tied_embeddings": False}


@st.composite
def damaged_clusters(draw):
    """Clusters where the model needs pipelines (small GPU memory) and failures break symmetry."""
    num_nodes = draw(st.integers(3, 8))
    gpus_per_node = draw(st.sampled_from([4, 8]))
    devices = [f"{n}:{g}" for n in range(num_nodes) for g in range(gpus_per_node)]
    failed = draw(st.lists(st.sampled_from(devices), min_size=1, max_size=3, unique=True))
    if draw(st.booleans()):
        failed.append(f"{draw(st.integers(0, num_nodes - 1))}:*")
    slow = [{"device": d, "speed": draw(st.sampled_from([0.25, 0.5, 0.8]))}
            for d in draw(st.lists(st.sampled_from(devices), max_size=2, unique=True))]
    return {
        "cluster": {"num_nodes": num_nodes, "gpus_per_node": gpus_per_node,
                    "gpu": {"name": "test-gpu", "peak_tflops": 300.0, "memory_gib": draw(st.sampled_from([12.0, 20.0]))}},
        "failures": {"failed": failed, "slow": slow},
        "model": PIPELINED_MODEL,
        "training": {"global_batch_size": draw(st.sampled_from([24, 30, 45, 64])), "seq_length": 2048},
        "options": {"time_limit_s": 5},
    }


@settings(max_examples=25)
@given(damaged_clusters())
def test_failure_aware_plans_satisfy_the_invariants(raw):
    request = PlanRequest.model_validate(raw)
    try:
        plan = plan_for(request)
    except InfeasibleError as error:
        assert re.search(r"\d", str(error))
        return
    speeds = {s.device: s.speed for s in request.failures.slow}
    check_invariants(plan, request, resolve_model(request.model), resolve_hardware(request.cluster).gpu, speeds)
