"""Shared helpers for the API and CLI tests: small requests, the invariant check, error assertions."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from tests.invariants import check_invariants
from wire.convert import resolve_hardware, resolve_model
from wire.schemas import EstimateRequest, Plan, PlanRequest

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "api" / "examples"
EXAMPLE_FILES = sorted(EXAMPLES_DIR.glob("*.json"))


def small_request(**overrides: Any) -> dict[str, Any]:
    """2 nodes x 8 A100-80GB, llama2-7b, a small batch: solves in well under a second."""
    body: dict[str, Any] = {
        "cluster": {"num_nodes": 2, "gpus_per_node": 8, "gpu": "A100-80GB"},
        "model": "llama2-7b",
        "training": {"global_batch_size": 32, "seq_length": 2048},
        "options": {"time_limit_s": 2},
    }
    body.update(copy.deepcopy(overrides))
    return body


def estimate_request(layout: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """4 nodes x 8 A100-80GB, llama2-7b (32 layers, 32 heads), global batch 256 at 4096 tokens."""
    body: dict[str, Any] = {
        "cluster": {"num_nodes": 4, "gpus_per_node": 8, "gpu": "A100-80GB"},
        "model": "llama2-7b",
        "training": {"global_batch_size": 256, "seq_length": 4096},
        "options": {"time_limit_s": 2},
        "layout": layout,
    }
    body.update(copy.deepcopy(overrides))
    return body


def verify_plan(plan_json: dict[str, Any], request_json: dict[str, Any]) -> Plan:
    """Validate against the wire schema, check API.md's 7 invariants and the stage `speed` field."""
    request = (EstimateRequest if "layout" in request_json else PlanRequest).model_validate(request_json)
    plan = Plan.model_validate(plan_json)
    speeds = {slow.device: slow.speed for slow in request.failures.slow}
    model = resolve_model(request.model)
    check_invariants(plan, request, model, resolve_hardware(request.cluster).gpu, speeds)
    replicas = sorted(plan.replicas, key=lambda r: r.id)
    first = replicas[0].stages[0]
    # with expert parallelism a stage runs at the pace of its EP group: the same stage of n consecutive replicas,
    # n = ep x etp / (tp x cp) (a group within one replica's CP ranks: n = 1)
    n = max(1, plan.ep * (plan.etp or first.tp) // (first.tp * first.cp)) if plan.uniform else plan.ep
    for index, replica in enumerate(replicas):
        group = replicas[index - index % n:index - index % n + n]
        for position, stage in enumerate(replica.stages):
            assert model.num_kv_heads % stage.tp == 0, f"tp {stage.tp} does not divide {model.num_kv_heads} KV heads"
            slowest = min(speeds.get(device, 1.0) for peer in group for device in peer.stages[position].devices)
            assert abs(stage.speed - slowest) < 1e-9, f"stage {stage.devices} speed {stage.speed} != slowest member {slowest}"
    return plan


def stage_devices(plan: Plan) -> list[str]:
    return [device for replica in plan.replicas for stage in replica.stages for device in stage.devices]


def detail_422(response) -> str:
    """The `detail` of a 422, after checking the one error shape: a sentence, and `errors` when fields failed."""
    assert response.status_code == 422, f"expected 422, got {response.status_code}: {response.text}"
    body = response.json()
    assert isinstance(body["detail"], str) and body["detail"], f"detail must be a sentence: {body!r}"
    assert set(body) <= {"detail", "errors"}, body
    return body["detail"]


def assert_detail(response, *fragments: str) -> str:
    """422 whose `detail` contains every fragment."""
    detail = detail_422(response)
    for fragment in fragments:
        assert fragment in detail, f"{fragment!r} not in detail {detail!r}"
    return detail


def _path_of(loc_part: tuple) -> str:
    """("slow", 0, "device") -> "slow[0].device", the form `errors[].field` takes."""
    path = ""
    for part in loc_part:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
    return path


def assert_validation(response, loc_part: tuple, *fragments: str) -> dict[str, Any]:
    """422 from request validation: some entry of `errors` names a field whose path contains loc_part and its
    message holds every fragment; `detail` names that field too."""
    detail = detail_422(response)
    errors = response.json().get("errors")
    assert isinstance(errors, list) and errors, f"expected field errors, got {response.json()!r}"
    wanted = _path_of(loc_part)
    for error in errors:
        assert set(error) == {"field", "message"}, error
        if wanted in error["field"] and all(f in error["message"] for f in fragments):
            if error is errors[0]:
                assert error["field"] in detail, (error, detail)
            return error
    raise AssertionError(f"no error at {wanted} with {fragments} in {json.dumps(errors)}")
