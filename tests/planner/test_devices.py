"""Slots of damaged nodes, against a direct reading of the rule: healthy GPUs fastest first (ties by
index), cut into consecutive groups of tp, each as fast as its slowest member; full-speed groups counted,
degraded ones listed fastest first, then by node and GPUs."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from planner.devices import build_cluster_state, damaged_node_slots, slot_inventory
from planner.nonuniform.partitions import damaged_classes

SPEEDS = st.sampled_from([0.25, 0.5, 0.7, 0.9])


def reference_slots(failed: set[tuple[int, int]], speeds: dict[tuple[int, int], float], node: int, gpus: int, tp: int):
    healthy = sorted((g for g in range(gpus) if (node, g) not in failed), key=lambda g: (-speeds.get((node, g), 1.0), g))
    groups = [healthy[i : i + tp] for i in range(0, len(healthy) - tp + 1, tp)]
    return [(node, tuple(sorted(group)), min(speeds.get((node, g), 1.0) for g in group)) for group in groups]


@st.composite
def clusters(draw):
    nodes, gpus = draw(st.integers(1, 5)), draw(st.sampled_from([1, 2, 4, 8]))
    devices = [(n, g) for n in range(nodes) for g in range(gpus)]
    failed = set(draw(st.lists(st.sampled_from(devices), max_size=len(devices))))
    slow = dict(draw(st.lists(st.tuples(st.sampled_from(devices), SPEEDS), max_size=len(devices))))
    return nodes, gpus, failed, slow


@given(clusters(), st.sampled_from([1, 2, 4, 8]))
def test_slots_and_inventories_follow_the_rule(cluster_case, tp):
    nodes, gpus, failed, slow = cluster_case
    cluster = build_cluster_state(nodes, gpus, [f"{n}:{g}" for n, g in failed],
                                  [(f"{n}:{g}", s) for (n, g), s in slow.items()])
    speeds = {d: s for d, s in slow.items() if d not in failed}
    if tp > gpus:
        return
    expected = [slot for node in range(nodes) for slot in reference_slots(failed, speeds, node, gpus, tp)]
    for node in range(nodes):
        got = [(s.node, s.devices, s.speed) for s in damaged_node_slots(cluster, node, tp)]
        assert got == reference_slots(failed, speeds, node, gpus, tp)
    inventory = slot_inventory(cluster, tp)
    assert inventory.full_speed_count == sum(1 for slot in expected if slot[2] >= 1.0)
    degraded = sorted((slot for slot in expected if slot[2] < 1.0), key=lambda slot: (-slot[2], slot[0], slot[1]))
    assert [(s.node, s.devices, s.speed) for s in inventory.degraded] == degraded
    for node in range(nodes):
        for g in range(gpus):
            assert cluster.speed_of(node, g) == speeds.get((node, g), 1.0)


@given(clusters())
def test_damaged_nodes_with_one_speed_profile_form_one_class(cluster_case):
    nodes, gpus, failed, slow = cluster_case
    cluster = build_cluster_state(nodes, gpus, [f"{n}:{g}" for n, g in failed],
                                  [(f"{n}:{g}", s) for (n, g), s in slow.items()])
    speeds = {d: s for d, s in slow.items() if d not in failed}
    damaged = sorted({n for n, _ in failed} | {n for n, _ in speeds})
    profiles: dict[tuple[float, ...], list[int]] = {}
    for node in damaged:
        profile = tuple(sorted((speeds.get((node, g), 1.0) for g in range(gpus) if (node, g) not in failed), reverse=True))
        profiles.setdefault(profile, []).append(node)
    assert [(c.profile, list(c.nodes)) for c in damaged_classes(cluster)] == sorted(profiles.items(), key=lambda kv: kv[1][0])
