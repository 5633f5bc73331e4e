"""Exports of stored plans over HTTP and from the command line."""

from __future__ import annotations

import json

from cli import main
from tests.api.support import small_request
from wire.schemas import Plan

SLOW_PIPELINE = small_request(
    cluster={"num_nodes": 2, "gpus_per_node": 8, "gpu": "A100-40GB"},
    model="llama2-13b",
    training={"global_batch_size": 16, "seq_length": 4096, "micro_batch_size": 1, "recompute": "full"},
    failures={"slow": [{"device": "0:0", "speed": 0.5}]},
)


def _stored_plan(client) -> Plan:
    response = client.post("/v1/plan", json=SLOW_PIPELINE)
    assert response.status_code == 200, response.text
    return Plan.model_validate(response.json())


def test_export_torch_csv_has_one_row_per_stage_of_the_slowest_replica(client):
    plan = _stored_plan(client)
    response = client.get(f"/v1/plans/{plan.plan_id}/export/torch-csv")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/csv")
    rows = [line.split(",") for line in response.text.strip().splitlines()]
    slowest = max(plan.pipeline_schedule.replicas, key=lambda r: r.makespan_ms)
    assert len(rows) == len(slowest.stages)
    p = len(slowest.stages)
    for rank, (row, timeline) in enumerate(zip(rows, slowest.stages)):
        # Same order; PyTorch's stage index is chunk * p + rank (looped placement).
        expected = []
        for label in timeline.ops:
            op, _, chunk = label.partition(".")
            expected.append(f"{int(chunk or 0) * p + rank}{op}")
        assert row == expected


def test_export_json_is_the_plan(client):
    plan = _stored_plan(client)
    response = client.get(f"/v1/plans/{plan.plan_id}/export/json")
    assert response.status_code == 200
    assert Plan.model_validate_json(response.text) == plan


def test_export_unknown_format_and_plan_are_404(client):
    plan = _stored_plan(client)
    response = client.get(f"/v1/plans/{plan.plan_id}/export/excel")
    assert response.status_code == 404
    assert "torch-csv" in response.json()["detail"]
    assert client.get("/v1/plans/nope/export/json").status_code == 404


def test_export_unknown_replica_is_422(client):
    plan = _stored_plan(client)
    response = client.get(f"/v1/plans/{plan.plan_id}/export/torch-csv", params={"replica": 999})
    assert response.status_code == 422
    assert "no replica 999" in response.json()["detail"]


def test_cli_export_writes_csv(tmp_path, capsys, client):
    plan = _stored_plan(client)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.model_dump_json())
    out_path = tmp_path / "replica.csv"
    assert main(["export", "--format", "torch-csv", str(plan_path), "--replica", "0", "-o", str(out_path)]) == 0
    rows = out_path.read_text().strip().splitlines()
    entry = next(r for r in plan.pipeline_schedule.replicas if 0 in r.replica_ids)
    assert len(rows) == len(entry.stages)


def test_cli_export_rejects_a_file_that_is_not_a_plan(tmp_path, capsys):
    path = tmp_path / "request.json"
    path.write_text(json.dumps(SLOW_PIPELINE))
    assert main(["export", "--format", "torch-csv", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("resiplan: invalid plan:")
    assert "plan_id" in err


def test_trainer_exports_over_http(client):
    stock = dict(SLOW_PIPELINE, options={"time_limit_s": 2, "allow_non_uniform": False})
    response = client.post("/v1/plan", json=stock)
    assert response.status_code == 200, response.text
    plan = Plan.model_validate(response.json())
    megatron = client.get(f"/v1/plans/{plan.plan_id}/export/megatron")
    assert megatron.status_code == 200, megatron.text
    assert megatron.headers["content-type"].startswith("text/x-shellscript")
    assert f"--pipeline-model-parallel-size {len(plan.replicas[0].stages)}" in megatron.text


def test_trainer_export_of_a_plan_it_cannot_run_is_422(client):
    zero_bubble = dict(SLOW_PIPELINE, options={"time_limit_s": 2, "schedules": ["zb-h1", "zb-h2"]})
    response = client.post("/v1/plan", json=zero_bubble)
    assert response.status_code == 200, response.text
    plan = Plan.model_validate(response.json())
    assert plan.schedule in {"zb-h1", "zb-h2"}
    response = client.get(f"/v1/plans/{plan.plan_id}/export/megatron")
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert "Megatron" in detail and "allow_non_uniform" in detail


def test_a_breadth_first_plan_exports_to_what_runs_it_and_nothing_else(client):
    """torchtitan names PyTorch's LoopedBFS and torch-csv lists its order; Megatron-LM and DeepSpeed have no
    breadth-first schedule and say so."""
    looped = small_request(model="llama2-13b", training={"global_batch_size": 16, "seq_length": 4096},
                           options={"time_limit_s": 3, "allow_non_uniform": False, "schedules": ["looped-bfs"]})
    response = client.post("/v1/plan", json=looped)
    assert response.status_code == 200, response.text
    plan = Plan.model_validate(response.json())
    assert plan.schedule == "looped-bfs" and plan.virtual_stages > 1
    torchtitan = client.get(f"/v1/plans/{plan.plan_id}/export/torchtitan")
    assert torchtitan.status_code == 200, torchtitan.text
    assert "--parallelism.pipeline_parallel_schedule LoopedBFS" in torchtitan.text
    assert client.get(f"/v1/plans/{plan.plan_id}/export/torch-csv").status_code == 200
    megatron = client.get(f"/v1/plans/{plan.plan_id}/export/megatron")
    assert megatron.status_code == 422 and '"looped-bfs"' in megatron.json()["detail"]
    deepspeed = client.get(f"/v1/plans/{plan.plan_id}/export/deepspeed")
    assert deepspeed.status_code == 422 and "breadth-first" in deepspeed.json()["detail"]
