"""Migration transfers: who sends which piece to whom.

The oracle cuts every unit's tensor-parallel dimension into G equal atoms (G a common multiple
of every interval's denominator) and follows each atom: a receiver ends up holding exactly what
its new shard needs, every transfer's atoms were its sender's, and what no alive device held is
the checkpoint's. It shares no code with `cost_models.transfers`.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_models.migration import UnitParams
from cost_models.transfers import migration_cost
from planner.replan.holdings import PlacedLayout, PlacedStage, device_holdings

GPUS_PER_NODE = 4
WEIGHT_BYTES, OPTIMIZER_BYTES = 2.0, 12.0


def _device(index: int) -> str:
    return f"{index // GPUS_PER_NODE}:{index % GPUS_PER_NODE}"


def _node(device: str) -> int:
    return int(device.split(":")[0])


def _atoms_of(holding, grid: int) -> set[tuple[str, int, int]]:
    """(state, unit, atom) triples a holding covers."""
    out = set()
    for block in holding:
        for kind, lo, hi in (("weights", block.weight_lo, block.weight_hi),
                             ("optimizer", block.optimizer_lo, block.optimizer_hi)):
            first, last = round(lo * grid), round(hi * grid)
            assert abs(first - lo * grid) < 1e-6 and abs(last - hi * grid) < 1e-6, "grid too coarse"
            out.update((kind, unit, atom) for unit in range(block.first_unit, block.end_unit) for atom in range(first, last))
    return out


def _grid(*layouts: PlacedLayout) -> int:
    sizes = [len(stage.devices) for layout in layouts for replica in layout.replicas for stage in replica]
    replicas = [len(layout.replicas) for layout in layouts]
    return math.lcm(*sizes) * math.lcm(*replicas)


def check_transfers(old: PlacedLayout, new: PlacedLayout, failed: set[str], units: UnitParams) -> None:
    held, needed = device_holdings(old), device_holdings(new)
    alive = frozenset(set(held) | set(needed)) - failed
    node_of = {device: _node(device) for device in set(held) | set(needed)}
    cost = migration_cost(held, needed, alive, node_of, units, 100.0, 10.0)
    grid = _grid(old, new)
    atom_bytes = {kind: per / grid for kind, per in (("weights", WEIGHT_BYTES), ("optimizer", OPTIMIZER_BYTES))}

    def size(atoms) -> float:
        return sum(units.params(unit, unit + 1) * atom_bytes[kind] for kind, unit, _ in atoms)

    old_atoms = {device: _atoms_of(holding, grid) for device, holding in held.items() if device in alive}
    received: dict[str, set] = {device: set() for device in needed}
    total = 0.0
    for t in cost.transfers:
        atoms = {(kind, unit, atom) for kind in t.states for unit in range(t.first_unit, t.end_unit)
                 for atom in range(int(t.part_lo * grid), int(t.part_hi * grid))}
        assert t.sender in old_atoms, f"{t.sender} sends but is failed or held nothing"
        assert atoms <= old_atoms[t.sender], f"{t.sender} sends state it never held"
        assert not (atoms & received[t.receiver]), f"{t.receiver} receives a piece twice"
        assert t.intra_node == (_node(t.sender) == _node(t.receiver))
        assert t.bytes == pytest.approx(size(atoms))
        received[t.receiver] |= atoms
        total += t.bytes
    checkpoint = 0.0
    for device, holding in needed.items():
        want = _atoms_of(holding, grid)
        own = old_atoms.get(device, set())
        assert not (received[device] & own), f"{device} receives what it holds already"
        assert received[device] <= want, f"{device} receives state its new shard does not hold"
        anywhere = set().union(*old_atoms.values()) if old_atoms else set()
        missing = want - own - received[device]
        assert not (missing & anywhere), f"{device} lacks pieces an alive device holds"
        checkpoint += size(missing)
        # A piece crossed the network only when no device of the receiver's node held it.
        for t in cost.transfers:
            if t.receiver == device and not t.intra_node:
                atoms = {(kind, unit, atom) for kind in t.states for unit in range(t.first_unit, t.end_unit)
                         for atom in range(int(t.part_lo * grid), int(t.part_hi * grid))}
                near = set().union(*(a for d, a in old_atoms.items() if _node(d) == _node(device)))
                assert not (atoms & near), f"{device} gets over the network what its node holds"
    assert cost.bytes_moved == pytest.approx(total, abs=1)
    assert cost.bytes_from_checkpoint == pytest.approx(checkpoint, abs=1)


@st.composite
def moves(draw):
    num_layers = draw(st.integers(2, 8))
    zero = draw(st.sampled_from([0, 1]))
    pool = list(range(3 * GPUS_PER_NODE))

    def layout(devices: list[int]) -> PlacedLayout:
        replicas = []
        for _ in range(draw(st.integers(1, 3))):
            count = draw(st.integers(1, min(3, num_layers)))
            cuts = sorted(draw(st.sets(st.integers(1, num_layers - 1), min_size=count - 1, max_size=count - 1)))
            bounds = [0, *cuts, num_layers]
            stages = []
            for first, end in zip(bounds, bounds[1:]):
                tp = draw(st.sampled_from([1, 2, 4]))
                if len(devices) < tp:
                    break
                stages.append(PlacedStage(tuple(_device(devices.pop(0)) for _ in range(tp)), (first, end)))
            if len(stages) == len(bounds) - 1:
                replicas.append(tuple(stages))
        if not replicas:
            replicas.append((PlacedStage((_device(devices.pop(0)),), (0, num_layers)),))
        return PlacedLayout(tuple(replicas), draw(st.integers(1, 2)), zero, num_layers)

    old = layout(draw(st.permutations(pool)))
    new = layout(draw(st.permutations(pool)))
    used = sorted({d for replica in old.replicas for stage in replica for d in stage.devices})
    failed = set(draw(st.lists(st.sampled_from(used), max_size=2)))
    return old, new, failed


@settings(max_examples=150, deadline=None)
@given(moves())
def test_transfers_rebuild_every_new_shard_from_alive_holders(move):
    old, new, failed = move
    check_transfers(old, new, failed, UnitParams(old.num_layers, 1000.0, 100.0, 700.0))


def test_tensor_parallel_two_to_one_takes_the_lost_partners_half_from_the_other_replica():
    # Layers 0-1 and 2-3 on TP-2 stages, two replicas on nodes 0 and 1, ZeRO-1. 0:1 fails; replica 0's
    # first stage becomes 0:0 alone.
    old = PlacedLayout(((PlacedStage(("0:0", "0:1"), (0, 2)), PlacedStage(("0:2", "0:3"), (2, 4))),
                        (PlacedStage(("1:0", "1:1"), (0, 2)), PlacedStage(("1:2", "1:3"), (2, 4)))), 1, 1, 4)
    new = PlacedLayout(((PlacedStage(("0:0",), (0, 2)), PlacedStage(("0:2", "0:3"), (2, 4))),
                        (PlacedStage(("1:0", "1:1"), (0, 2)), PlacedStage(("1:2", "1:3"), (2, 4)))), 1, 1, 4)
    units = UnitParams(4, 1000.0, 100.0, 700.0)
    held, needed = device_holdings(old), device_holdings(new)
    node_of = {d: _node(d) for d in held}
    cost = migration_cost(held, needed, frozenset(held) - {"0:1"}, node_of, units, 100.0, 10.0)
    # Units 0-2 (embedding and layers 0-1: 1,200 parameters). 0:0 needs the weights' second half: only
    # 1:1 holds it alive. Its optimizer share is, of each half, the first quarter of the whole: [0, 1/4)
    # (its own) and [1/2, 3/4) (0:1's, lost: the checkpoint's).
    assert [(t.sender, t.receiver, t.first_unit, t.end_unit, t.part_lo, t.part_hi, t.states) for t in cost.transfers] == [
        ("1:1", "0:0", 0, 3, Fraction(1, 2), Fraction(1), ("weights",)),
    ]
    assert cost.transfers[0].bytes == 1200 * 2 / 2
    assert cost.transfers[0].receiver_tp_shard == (0, 1)
    assert cost.bytes_from_checkpoint == 1200 * 12 / 4
    assert cost.estimated_s == pytest.approx(1200 / 10e9)  # one network transfer: 1:1's send, 0:0's receive
    check_transfers(old, new, {"0:1"}, units)


def test_under_zero_3_a_lost_gpus_weight_shard_comes_from_the_checkpoint():
    # The same move as above with ZeRO-3: each replica's GPU holds only its quarter of the weights too,
    # so 0:1's weight shard ([1/2, 3/4) of units 0-2) is gone with it, like its optimizer shard.
    old = PlacedLayout(((PlacedStage(("0:0", "0:1"), (0, 2)), PlacedStage(("0:2", "0:3"), (2, 4))),
                        (PlacedStage(("1:0", "1:1"), (0, 2)), PlacedStage(("1:2", "1:3"), (2, 4)))), 1, 3, 4)
    new = PlacedLayout(((PlacedStage(("0:0",), (0, 2)), PlacedStage(("0:2", "0:3"), (2, 4))),
                        (PlacedStage(("1:0", "1:1"), (0, 2)), PlacedStage(("1:2", "1:3"), (2, 4)))), 1, 3, 4)
    units = UnitParams(4, 1000.0, 100.0, 700.0)
    held, needed = device_holdings(old), device_holdings(new)
    node_of = {d: _node(d) for d in held}
    cost = migration_cost(held, needed, frozenset(held) - {"0:1"}, node_of, units, 100.0, 10.0)
    # 0:0 (replica 0, now TP 1) holds [0, 1/4) and needs [1/2, 3/4) of units 0-2: 0:1's, gone.
    assert cost.transfers == ()
    assert cost.bytes_from_checkpoint == 1200 * (2 + 12) / 4
    check_transfers(old, new, {"0:1"}, units)


def test_receivers_prefer_their_node_and_share_the_senders():
    # One stage of all 2 layers on 0:0, 0:1 and 1:0 (three replicas, no ZeRO). The new layout adds
    # replicas on 0:2 and 0:3: each takes the whole model from a different device of node 0.
    def whole(devices: list[str]) -> PlacedLayout:
        return PlacedLayout(tuple((PlacedStage((d,), (0, 2)),) for d in devices), 1, 0, 2)

    old, new = whole(["0:0", "0:1", "1:0"]), whole(["0:0", "0:1", "1:0", "0:2", "0:3"])
    held, needed = device_holdings(old), device_holdings(new)
    node_of = {d: _node(d) for d in needed}
    cost = migration_cost(held, needed, frozenset(needed), node_of, UnitParams(2, 1000.0, 100.0, 700.0), 100.0, 10.0)
    assert sorted((t.sender, t.receiver) for t in cost.transfers) == [("0:0", "0:2"), ("0:1", "0:3")]
    assert all(t.intra_node and t.states == ("weights", "optimizer") for t in cost.transfers)
    per_receiver = (1000 + 200 + 700) * 14
    assert cost.bytes_moved == 2 * per_receiver
    assert cost.estimated_s == pytest.approx(per_receiver / 100e9)  # two senders side by side over NVLink


def test_shards_cut_at_a_float_share_move_exactly_what_each_receiver_lacks():
    """A mixture of experts cuts shards at the routed experts' float share of a layer: every such end brings its own
    denominator near 2^24, and their least common multiple once outgrew a float (a 500 on replan). Each receiver
    must still get exactly the part of its new interval it did not hold, summed here without the grid."""
    from cost_models.memory import OPTIMIZER_BYTES_PER_PARAM
    from cost_models.migration import WEIGHT_BYTES_PER_PARAM, ShardBlock

    share = 0.0323456789
    old_cuts = sorted({0.0, 1.0} | {(share * k) % 1.0 for k in range(1, 80)})
    new_cuts = sorted({0.0, 1.0} | {(share * k * 7 / 3) % 1.0 for k in range(1, 80)})

    def holdings(cuts: list[float], first: int) -> dict[str, tuple]:
        return {_device(first + i): (ShardBlock(1, 2, lo, hi, lo, hi),) for i, (lo, hi) in enumerate(zip(cuts, cuts[1:]))}

    old, new = holdings(old_cuts, 0), holdings(new_cuts, 40)
    alive = frozenset(old) | frozenset(new)
    units = UnitParams(num_layers=1, embedding=0.0, per_layer=1e9, head=0.0)
    cost = migration_cost(old, new, alive, {device: _node(device) for device in alive}, units, 100.0, 10.0)

    def own(device: str, lo: float, hi: float) -> float:
        return sum(max(0.0, min(hi, b.weight_hi) - max(lo, b.weight_lo)) for b in old.get(device, ()))

    lacking = sum(block.weight_hi - block.weight_lo - own(device, block.weight_lo, block.weight_hi)
                  for device, (block,) in new.items())
    expected = lacking * units.per_layer * (WEIGHT_BYTES_PER_PARAM + OPTIMIZER_BYTES_PER_PARAM)
    assert math.isfinite(cost.estimated_s) and cost.bytes_from_checkpoint == 0
    assert cost.bytes_moved == pytest.approx(expected, rel=1e-9)


def _two_new_replicas(units: UnitParams, peer_link_gb_s: float | None = None):
    """test_receivers_prefer_their_node_and_share_the_senders's move: 0:2 and 0:3 each take the whole model from
    a different device of node 0."""
    def whole(devices: list[str]) -> PlacedLayout:
        return PlacedLayout(tuple((PlacedStage((d,), (0, 2)),) for d in devices), 1, 0, 2)

    held, needed = device_holdings(whole(["0:0", "0:1", "1:0"])), device_holdings(whole(["0:0", "0:1", "1:0", "0:2", "0:3"]))
    return migration_cost(held, needed, frozenset(needed), {d: _node(d) for d in needed}, units, 100.0, 10.0,
                          peer_link_gb_s=peer_link_gb_s)


def test_without_master_weights_the_optimizer_state_is_4_bytes_a_parameter():
    cost = _two_new_replicas(UnitParams(2, 1000.0, 100.0, 700.0, optimizer_bytes_per_param=4.0))
    per_receiver = (1000 + 200 + 700) * (2 + 4)  # bf16 weights, bf16 Adam moments
    assert cost.bytes_moved == 2 * per_receiver
    assert cost.estimated_s == pytest.approx(per_receiver / 100e9)


def test_on_a_mesh_a_pair_of_gpus_moves_over_its_one_peer_link():
    units = UnitParams(2, 1000.0, 100.0, 700.0)
    per_receiver = (1000 + 200 + 700) * 14
    # Each receiver's whole share crosses one link of a third of the GPU's NVLink (4 GPUs, three peers each).
    assert _two_new_replicas(units, 100.0 / 3).estimated_s == pytest.approx(per_receiver / (100e9 / 3))
    # Through a switch a pair can use all of it: the device's own total binds, as without the argument.
    assert _two_new_replicas(units, 100.0).estimated_s == pytest.approx(per_receiver / 100e9)


def test_on_a_mesh_one_sender_feeding_two_peers_drives_two_links():
    # 0:0 alone holds the model; 0:1 and 0:2 each need all of it.
    held = {"0:0": device_holdings(PlacedLayout(((PlacedStage(("0:0",), (0, 2)),),), 1, 0, 2))["0:0"]}
    needed = device_holdings(PlacedLayout(tuple((PlacedStage((d,), (0, 2)),) for d in ("0:0", "0:1", "0:2")), 1, 0, 2))
    units = UnitParams(2, 1000.0, 100.0, 700.0)
    model_bytes = (1000 + 200 + 700) * 14
    node_of = {d: 0 for d in needed}
    switch = migration_cost(held, needed, frozenset(needed), node_of, units, 100.0, 10.0)
    mesh = migration_cost(held, needed, frozenset(needed), node_of, units, 100.0, 10.0, peer_link_gb_s=100.0 / 3)
    assert switch.estimated_s == pytest.approx(2 * model_bytes / 100e9)  # the sender's NVLink carries both copies
    assert mesh.estimated_s == pytest.approx(model_bytes / (100e9 / 3))  # each copy on its own third of it
