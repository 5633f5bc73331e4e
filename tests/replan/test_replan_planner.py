"""Replanning in the planner: placement that moves the fewest bytes, and the keep-or-move choice."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cost_models.device import device_id
from cost_models.migration import unit_params
from cost_models.transfers import MigrationCost
from planner.plan import plan
from planner.replan.choice import (
    ReplanCandidate,
    ReplanResult,
    objective_ms,
    plan_migration,
    replan,
    running_plan,
)
from planner.replan.holdings import device_holdings, placed_layout
from planner.replan.placement import matched_device_map, relabel
from wire.convert import to_problem
from wire.schemas import PlanRequest


def _problem(failed=(), slow=()):
    return to_problem(PlanRequest.model_validate({
        "cluster": {"num_nodes": 4, "gpus_per_node": 8, "gpu": "A100-80GB"},
        "failures": {"failed": list(failed), "slow": [{"device": d, "speed": s} for d, s in slow]},
        "model": "llama2-13b",
        "training": {"global_batch_size": 64, "seq_length": 4096},
        "options": {"time_limit_s": 3},
    }))


def _running(result):
    return running_plan(result, dict(result.slow_devices))


def _bytes(problem, old, new) -> int:
    return plan_migration(problem, old, new).bytes_moved


@pytest.fixture(scope="module")
def healthy():
    problem = _problem()
    return problem, plan(problem)


def test_matching_finds_the_running_placement_of_the_same_layout(healthy):
    problem, result = healthy
    # The job runs the same layout with nodes 0 and 2 swapped and GPUs reversed inside every node.
    nodes = {0: 2, 2: 0, 1: 1, 3: 3}
    shuffle = {device_id(n, g): device_id(nodes[n], 7 - g) for n in range(4) for g in range(8)}
    running = relabel(result, shuffle)
    assert _bytes(problem, running, result) > 0  # placing it afresh would move state
    units = unit_params(problem.workload.model)
    placed = relabel(result, matched_device_map(result, problem.cluster, device_holdings(placed_layout(running)), units))
    assert _bytes(problem, running, placed) == 0


def test_matching_keeps_every_stage_on_devices_of_its_speed(healthy):
    problem = _problem(failed=["1:3"], slow=[("2:5", 0.5)])
    running = healthy[1]
    result = plan(problem)
    units = unit_params(problem.workload.model)
    placed = relabel(result, matched_device_map(result, problem.cluster, device_holdings(placed_layout(running)), units))
    cluster = problem.cluster

    def speed(device):
        node, gpu = (int(x) for x in device.split(":"))
        return 0.0 if (node, gpu) in cluster.failed else cluster.speed_of(node, gpu)

    for before, after in zip(result.replicas, placed.replicas):
        for a, b in zip(before.stages, after.stages):
            assert sorted(speed(d) for d in a.devices) == sorted(speed(d) for d in b.devices)
            assert len({d.split(":")[0] for d in b.devices}) == 1
    used = [d for r in placed.replicas for s in r.stages for d in s.devices]
    assert len(used) == len(set(used)) and "1:3" not in used
    assert _bytes(problem, running, placed) <= _bytes(problem, running, result)


def test_nothing_changed_keeps_the_running_plan(healthy):
    problem, result = healthy
    found = replan(problem, _running(result))
    assert found.result is None
    assert found.chosen.name == "keep"
    assert found.migration.bytes_moved == 0 and found.migration.devices_changed == ()


def test_a_failed_device_in_use_forces_a_move_with_fewer_bytes_than_from_scratch(healthy):
    problem = _problem(failed=["1:3"])
    found = replan(problem, _running(healthy[1]))
    names = {c.name: c for c in found.candidates}
    assert "keep" not in names
    assert found.result is not None and found.chosen.name == "replan"
    assert names["replan"].iteration_s == names["scratch"].iteration_s
    assert 0 < names["replan"].migration.bytes_moved < names["scratch"].migration.bytes_moved
    assert "1:3" not in {d for r in found.result.replicas for s in r.stages for d in s.devices}


def test_keep_adds_at_most_the_time_its_slowed_stages_gain(healthy):
    _, result = healthy
    replica = result.replicas[0]
    stage = replica.stages[0]
    slowed = _problem(slow=[(stage.devices[0], 0.8)])
    found = replan(slowed, _running(result), amortize_iterations=1)
    keep = next(c for c in found.candidates if c.name == "keep")
    # The stage's busy time grows by 1/0.8 - 1 = 25%, and so may the optimizer step.
    busy_s = replica.num_microbatches * (stage.forward_ms + stage.backward_ms) / 1e3
    expected = result.predicted.iteration_time_s + 0.25 * busy_s + 0.25 * result.predicted.breakdown["optimizer_s"]
    assert keep.iteration_s == pytest.approx(expected)
    assert keep.iteration_s < result.predicted.iteration_time_s / 0.8  # tighter than scaling everything


def _candidate(name, iteration_s, migration_s):
    cost = MigrationCost(1, 0, (), migration_s)
    return ReplanCandidate(name, iteration_s, cost, objective_ms(iteration_s, cost, 100))


def test_choice_is_the_least_iteration_plus_amortized_migration_and_never_scratch():
    assert objective_ms(2.0, MigrationCost(0, 0, (), 50.0), 100) == pytest.approx(2000 + 500)
    # Moving saves 0.1 s per iteration and costs 20 s: over 100 iterations it does not pay.
    found = ReplanResult(None, MigrationCost(0, 0, (), 0.0), 100, (
        _candidate("replan", 1.9, 20.0), _candidate("scratch", 1.9, 0.0), _candidate("keep", 2.0, 0.0)))
    assert found.chosen.name == "keep"
    # Costing 5 s, it does.
    found = replace(found, candidates=(_candidate("replan", 1.9, 5.0), _candidate("keep", 2.0, 0.0)))
    assert found.chosen.name == "replan"


def _h100_problem(**training_and_cluster):
    return to_problem(PlanRequest.model_validate({
        "cluster": {"num_nodes": 2, "gpus_per_node": 4, "gpu": "H100-SXM", **training_and_cluster.pop("cluster", {})},
        "model": "llama2-7b",
        "training": {"global_batch_size": 32, "seq_length": 2048, "zero_stage": 0, **training_and_cluster},
        "options": {"time_limit_s": 2},
    }))


@pytest.fixture(scope="module")
def shifted_in_node():
    """A plan and the same layout with every node's GPUs shifted by one: state moves, only inside nodes."""
    result = plan(_h100_problem())
    shuffle = {device_id(n, g): device_id(n, (g + 1) % 4) for n in range(2) for g in range(4)}
    return result, relabel(result, shuffle)


def test_a_migration_moves_the_optimizer_state_the_job_keeps(shifted_in_node):
    old, new = shifted_in_node
    fp32 = plan_migration(_h100_problem(), old, new)
    bf16 = plan_migration(_h100_problem(optimizer_precision="bf16"), old, new)
    assert fp32.bytes_moved > 0
    # Without ZeRO weights and optimizer state move together: 2 + 4 bytes a parameter against 2 + 12.
    assert bf16.bytes_moved == pytest.approx(fp32.bytes_moved * 6 / 14, rel=1e-9)


def test_on_a_mesh_a_migration_is_priced_on_the_peer_links(shifted_in_node):
    old, new = shifted_in_node
    switch = plan_migration(_h100_problem(), old, new)
    problem = _h100_problem(cluster={"nvlink_topology": "mesh"})
    mesh = plan_migration(problem, old, new)
    assert mesh.bytes_moved == switch.bytes_moved and all(t.intra_node for t in mesh.transfers)
    pairs: dict[tuple[str, str], float] = {}
    for t in mesh.transfers:
        pairs[(t.sender, t.receiver)] = pairs.get((t.sender, t.receiver), 0.0) + t.bytes
    peer_link_bytes_s = problem.hardware.intra_node_bandwidth_gb_s * 1e9 / 3  # one of a GPU's three peers
    assert mesh.estimated_s == pytest.approx(max(pairs.values()) / peer_link_bytes_s)
    assert mesh.estimated_s > switch.estimated_s
