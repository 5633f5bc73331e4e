"""cluster.nvlink_topology: "mesh" nodes (4-GPU HGX boards, NVL bridges) price collectives on the peer links they
use; the search plans with it; anything but "switch" or "mesh" is a 422 naming the field."""

from __future__ import annotations

from api.tasks.planning import estimate_for, plan_for
from tests.api.support import estimate_request, small_request
from wire.schemas import EstimateRequest, PlanRequest


def _cluster(topology: str | None) -> dict:
    cluster = {"num_nodes": 2, "gpus_per_node": 4, "gpu": "H200"}
    if topology is not None:
        cluster["nvlink_topology"] = topology
    return cluster


def _estimate(topology: str | None, tp: int):
    body = estimate_request({"tp": tp, "pp": 1, "micro_batch_size": 2, "recompute": "full"}, cluster=_cluster(topology),
                            model="llama3-8b", training={"global_batch_size": 32, "seq_length": 4096})
    return estimate_for(EstimateRequest.model_validate(body)).predicted


def test_switch_is_the_default():
    assert _estimate(None, 2).iteration_time_s == _estimate("switch", 2).iteration_time_s


def test_tp2_on_a_mesh_is_slower_and_tp4_is_not():
    switch, mesh = _estimate("switch", 2), _estimate("mesh", 2)
    assert 2.9 < mesh.breakdown.tp_comm_s / switch.breakdown.tp_comm_s <= 3.0
    assert mesh.iteration_time_s > switch.iteration_time_s
    assert _estimate("mesh", 4).breakdown.tp_comm_s == _estimate("switch", 4).breakdown.tp_comm_s


def test_the_search_prices_the_mesh():
    """Llama 3 70B on 4 nodes of 4 H200s: through NVSwitch the best plan runs TP 2 x PP 8; on a mesh that layout
    pays its TP collectives at a third of the bandwidth, and the search moves to TP 4, which drives every link.
    Links only get slower on a mesh, so its plan is no faster than the switch's, and faster than the switch's
    layout priced on the mesh."""
    def planned(topology: str):
        body = small_request(cluster=_cluster(topology) | {"num_nodes": 4}, model="llama3-70b",
                             training={"global_batch_size": 32, "seq_length": 4096},
                             options={"time_limit_s": 10, "allow_non_uniform": False})
        return plan_for(PlanRequest.model_validate(body))

    switch, mesh = planned("switch"), planned("mesh")
    assert {stage.tp for stage in switch.replicas[0].stages} == {2}
    assert {stage.tp for stage in mesh.replicas[0].stages} == {4}
    assert mesh.predicted.iteration_time_s >= switch.predicted.iteration_time_s
    stages = switch.replicas[0].stages
    switch_layout_on_mesh = estimate_for(EstimateRequest.model_validate(estimate_request(
        {"tp": 2, "pp": len(stages), "micro_batch_size": switch.micro_batch_size, "recompute": switch.recompute},
        cluster=_cluster("mesh") | {"num_nodes": 4}, model="llama3-70b",
        training={"global_batch_size": 32, "seq_length": 4096})))
    assert mesh.predicted.iteration_time_s < switch_layout_on_mesh.predicted.iteration_time_s


def test_an_unknown_topology_is_a_422(client):
    body = estimate_request({"tp": 2, "pp": 1}, cluster=_cluster("nvswitch"))
    response = client.post("/v1/estimate", json=body)
    assert response.status_code == 422
    assert "nvlink_topology" in response.text and "mesh" in response.text
