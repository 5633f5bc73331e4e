"""Migration bytes and seconds, against values worked out by hand."""

from __future__ import annotations

import pytest

from cost_models.migration import ShardBlock, UnitParams, common_bytes, missing_bytes
from cost_models.transfers import migration_cost

# 4 layers of 100 parameters, an embedding of 1,000 and a head of 500: units 0..5.
UNITS = UnitParams(num_layers=4, embedding=1000.0, per_layer=100.0, head=500.0)


def whole(first: int, end: int) -> ShardBlock:
    return ShardBlock(first, end, 0.0, 1.0, 0.0, 1.0)


def test_unit_params_count_embedding_layers_and_head():
    assert UNITS.params(0, 6) == 1000 + 4 * 100 + 500
    assert UNITS.params(1, 3) == 200
    assert UNITS.params(5, 6) == 500
    assert UNITS.params(3, 3) == 0


def test_a_device_keeping_its_shard_receives_nothing():
    held = (whole(0, 3),)
    assert missing_bytes(held, held, UNITS) == 0.0


def test_tensor_parallel_half_to_whole_receives_the_other_half_of_weights_and_optimizer():
    # Rank 0 of TP 2 on layers 1..2 (200 params) becomes TP 1: it lacks half of 2 + 12 bytes per param.
    held = (ShardBlock(1, 3, 0.0, 0.5, 0.0, 0.5),)
    needed = (whole(1, 3),)
    assert missing_bytes(needed, held, UNITS) == pytest.approx(200 * 0.5 * (2 + 12))


def test_zero_shards_move_only_the_optimizer_part():
    # Same weights, optimizer share moves from [0, 0.25) to [0.25, 0.5): 12 bytes per param of a quarter.
    held = (ShardBlock(1, 2, 0.0, 1.0, 0.0, 0.25),)
    needed = (ShardBlock(1, 2, 0.0, 1.0, 0.25, 0.5),)
    assert missing_bytes(needed, held, UNITS) == pytest.approx(100 * 0.25 * 12)


def test_layer_boundary_shift_moves_one_layer_and_the_embedding_stays():
    held = (whole(0, 3),)  # embedding + layers 0, 1
    needed = (whole(0, 2),)  # embedding + layer 0
    assert missing_bytes(needed, held, UNITS) == 0.0
    assert common_bytes((whole(3, 5),), held, UNITS) == 0.0
    assert missing_bytes((whole(2, 4),), held, UNITS) == pytest.approx(100 * 14)


def test_state_only_a_failed_device_held_comes_from_the_checkpoint():
    # Two replicas, ZeRO-1: each holds full weights and half the optimizer of layer unit 1.
    a = (ShardBlock(1, 2, 0.0, 1.0, 0.0, 0.5),)
    b = (ShardBlock(1, 2, 0.0, 1.0, 0.5, 1.0),)
    # b fails and a takes the whole optimizer state: its weights survive on a, b's optimizer half does not.
    cost = migration_cost({"0:0": a, "0:1": b}, {"0:0": (whole(1, 2),)}, frozenset({"0:0"}),
                          {"0:0": 0, "0:1": 0}, UNITS, 100.0, 10.0)
    assert cost.bytes_from_checkpoint == pytest.approx(100 * 0.5 * 12)
    assert cost.bytes_moved == 0 and cost.transfers == ()
    # Without ZeRO both hold everything: nothing is lost.
    cost = migration_cost({"0:0": (whole(1, 2),), "0:1": (whole(1, 2),)}, {"0:0": (whole(1, 2),)},
                          frozenset({"0:0"}), {"0:0": 0, "0:1": 0}, UNITS, 100.0, 10.0)
    assert cost.bytes_from_checkpoint == 0


def test_estimate_uses_nvlink_from_a_node_peer_and_the_network_otherwise():
    held_old = {"0:0": (whole(1, 2),), "1:0": (whole(2, 3),)}
    # 0:1 (new, node 0) needs unit 1, which 0:0 holds: NVLink. 1:1 needs unit 1 too: network.
    new = {"0:0": (whole(1, 2),), "1:0": (whole(2, 3),), "0:1": (whole(1, 2),), "1:1": (whole(1, 2),)}
    alive = frozenset(new)
    node_of = {"0:0": 0, "0:1": 0, "1:0": 1, "1:1": 1}
    cost = migration_cost(held_old, new, alive, node_of, UNITS, intra_node_bandwidth_gb_s=100.0,
                          inter_node_bandwidth_gb_s=10.0)
    bytes_each = 100 * 14
    assert cost.bytes_moved == 2 * bytes_each
    assert cost.devices_changed == ("0:1", "1:1")
    assert cost.estimated_s == pytest.approx(bytes_each / 10e9)  # the network receiver is the slowest
    assert cost.bytes_from_checkpoint == 0


def test_a_failed_device_is_no_source_and_a_leaving_device_counts_as_changed():
    old = {"0:0": (whole(1, 3),), "0:1": (whole(3, 5),)}
    new = {"0:1": (whole(1, 3),)}
    # 0:0 failed: 0:1 must receive layers 0..1 from elsewhere; they exist nowhere else alive.
    cost = migration_cost(old, new, frozenset({"0:1"}), {"0:0": 0, "0:1": 0}, UNITS, 100.0, 10.0)
    assert cost.bytes_moved == 0  # no alive peer holds them: nothing moves between devices
    assert cost.bytes_from_checkpoint == 200 * 14
    assert cost.devices_changed == ("0:1",)
