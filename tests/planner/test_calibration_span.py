"""planner.calibration_span: where ZeRO-2/3's per-layer collectives run, and the extrapolation it names."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.calibration_span import (SHARDED_ACROSS_NODES, SHARDED_IN_NODE, UNSHARDED, CalibrationSpan,
                                      extrapolations, shard_reach)


@pytest.mark.parametrize(("zero_stage", "shard_replicas", "tp", "cp", "reach"), [
    (3, 8, 1, 1, SHARDED_IN_NODE),  # 8 GPUs: one node of 8
    (3, 16, 1, 1, SHARDED_ACROSS_NODES),  # 16 GPUs
    (2, 4, 2, 1, SHARDED_IN_NODE),  # 4 replicas of a tp-2 stage: 8 GPUs
    (3, 4, 4, 1, SHARDED_ACROSS_NODES),  # 16 GPUs
    (3, 2, 1, 4, SHARDED_IN_NODE),  # FSDP over dp x cp (torchtitan's): 2 x 4 ranks, 8 GPUs
    (3, 1, 2, 8, SHARDED_ACROSS_NODES),  # one replica, its 8 CP ranks of tp 2: 16 GPUs
    (1, 16, 1, 1, UNSHARDED),  # ZeRO-1 reduce-scatters once a step, not per layer
    (0, 16, 1, 1, UNSHARDED),
    (3, 1, 8, 1, UNSHARDED),  # a shard group of one TP group has nobody to gather from
])
def test_shard_reach_on_nodes_of_eight(zero_stage, shard_replicas, tp, cp, reach):
    assert shard_reach(zero_stage, shard_replicas, tp, cp, gpus_per_node=8) == reach


def _span(*reaches: str) -> CalibrationSpan:
    return CalibrationSpan(frozenset({"H100-SXM"}), frozenset({"switch"}), frozenset({"bf16"}), (1, 1), (1, 1), (1, 1),
                           (7, 7), (4096, 4096), frozenset(reaches))


def test_only_sharding_the_runs_did_not_measure_is_named():
    in_node = _span(UNSHARDED, SHARDED_IN_NODE)
    assert extrapolations(in_node, _span(SHARDED_ACROSS_NODES)) == [
        "ZeRO-2/3 sharding across nodes: the calibration's runs sharded within a node"]
    assert extrapolations(in_node, _span(SHARDED_IN_NODE)) == []
    # A plan without per-layer collectives does not use the fitted overlap, whatever the runs sharded.
    assert extrapolations(_span(SHARDED_ACROSS_NODES), _span(UNSHARDED)) == []
    assert extrapolations(_span(UNSHARDED), _span(SHARDED_IN_NODE)) == [
        "ZeRO-2/3 sharding within a node: the calibration's runs sharded nothing per layer"]


def test_joined_spans_keep_every_reach():
    joined = _span(SHARDED_IN_NODE).joined(replace(_span(SHARDED_ACROSS_NODES), tp=(2, 4)))
    assert joined.shard_reaches == {SHARDED_IN_NODE, SHARDED_ACROSS_NODES} and joined.tp == (1, 4)
