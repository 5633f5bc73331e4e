"""The wire form of a plan result carries every field of every replica and stage unchanged."""

from __future__ import annotations

from dataclasses import asdict

from planner.plan import plan
from tests.planner.helpers import small_problem
from wire.convert import to_wire


def test_wire_replicas_equal_the_dataclasses_field_for_field():
    # A damaged, non-uniform case: stages of different TP sizes and speeds.
    result = plan(small_problem(num_nodes=2, gpus_per_node=4, failed=("0:1",), slow=(("1:2", 0.5),)))
    wire = to_wire(result, "id")
    expected = [asdict(replica) for replica in result.replicas]
    got = [replica.model_dump() for replica in wire.replicas]
    for replica in expected:
        replica["stages"] = list(replica["stages"])
        for stage in replica["stages"]:
            stage["layers"], stage["devices"] = tuple(stage["layers"]), list(stage["devices"])
            del stage["grad_sync"]  # internal: what the schedules price the gradient sync with
            del stage["chunk_shares"]  # internal: each uneven chunk's share of the stage's work
    assert got == expected
    assert wire.plan_id == "id" and wire.predicted.iteration_time_s == result.predicted.iteration_time_s
