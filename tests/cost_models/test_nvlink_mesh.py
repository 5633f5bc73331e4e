"""A node whose GPUs are linked directly (no NVSwitch): each GPU's NVLink split among its peers.

On a 4-GPU mesh a GPU reaches each peer over a third of its links, so TP 2 moves its collectives at a third of
the bandwidth an NVSwitch board gives it, and TP 4, which drives every link, at all of it
(`cost_models.layout.nvlink_group_gb_s`).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from cost_models.efficiency import SoftwareConfig
from cost_models.gpu_efficiency import builtin_efficiency
from cost_models.hardware import gpu_preset
from cost_models.layout import Hardware, ParallelShape, Workload, nvlink_group_gb_s
from cost_models.model_spec import model_preset
from cost_models.stage_costs import part_costs, pipeline_p2p_ms, stage_cost_terms

H200 = gpu_preset("H200")


def _hardware(gpus_per_node: int, mesh: bool) -> Hardware:
    return Hardware(H200, gpus_per_node, H200.intra_node_bandwidth_gb_s, H200.inter_node_bandwidth_gb_s,
                    nvlink_mesh=mesh)


def test_a_group_of_g_gets_g_minus_one_of_the_n_minus_one_peer_links():
    full = H200.intra_node_bandwidth_gb_s
    mesh4 = _hardware(4, True)
    assert nvlink_group_gb_s(mesh4, 2) == pytest.approx(full / 3)
    assert nvlink_group_gb_s(mesh4, 3) == pytest.approx(full * 2 / 3)
    assert nvlink_group_gb_s(mesh4, 4) == full
    assert nvlink_group_gb_s(mesh4, 8) == full  # a group wider than the node crosses it through every link
    assert nvlink_group_gb_s(_hardware(8, True), 2) == pytest.approx(full / 7)
    for group in (2, 3, 4, 8):
        assert nvlink_group_gb_s(_hardware(4, False), group) == full
    assert nvlink_group_gb_s(_hardware(2, True), 2) == full  # two GPUs: every link joins the pair


def _layer_time(tp: int, mesh: bool, gpus_per_node: int = 4):
    workload = Workload(model_preset("llama3-8b"), 8192, 64, zero_stage=1)
    shape = ParallelShape(tp=tp, pp=1, dp=gpus_per_node // tp, micro_batch_size=4, recompute="none")
    return part_costs(workload, _hardware(gpus_per_node, mesh), shape, builtin_efficiency(H200),
                      SoftwareConfig()).layer.time


def test_tp2_on_a_4_gpu_mesh_moves_its_collectives_at_a_third_of_the_bandwidth():
    switch, mesh = _layer_time(2, False), _layer_time(2, True)
    ratio = mesh.forward_tp_comm_ms / switch.forward_tp_comm_ms
    assert 2.9 < ratio <= 3.0  # 3x on bandwidth, the per-step latency unchanged
    assert 2.9 < mesh.backward_tp_comm_ms / switch.backward_tp_comm_ms <= 3.0
    assert mesh.forward_compute_ms == switch.forward_compute_ms


def test_tp_over_the_whole_mesh_costs_what_it_costs_through_a_switch():
    assert _layer_time(4, True) == _layer_time(4, False)


def test_tp2_on_an_8_gpu_mesh_gets_a_seventh():
    ratio = _layer_time(2, True, 8).forward_tp_comm_ms / _layer_time(2, False, 8).forward_tp_comm_ms
    assert 6.8 < ratio <= 7.0


def test_pipeline_sends_and_data_parallel_sync_inside_a_mesh_node_use_the_peer_links():
    workload = Workload(model_preset("llama3-8b"), 8192, 64, zero_stage=1)
    efficiency, software = builtin_efficiency(H200), SoftwareConfig(overlap_grad_reduce=False, overlap_param_gather=False)
    pipelined = ParallelShape(tp=1, pp=2, dp=2, micro_batch_size=1, recompute="full")
    switch_p2p = pipeline_p2p_ms(workload, _hardware(4, False), pipelined, efficiency, software)
    mesh_p2p = pipeline_p2p_ms(workload, _hardware(4, True), pipelined, efficiency, software)
    assert 2.5 < mesh_p2p / switch_p2p <= 3.0
    # Two replicas of TP 2 in a node sync over one peer's links; four of TP 1 over all three.
    pairs = ParallelShape(tp=2, pp=1, dp=2, micro_batch_size=1, recompute="full")
    quads = ParallelShape(tp=1, pp=1, dp=4, micro_batch_size=1, recompute="full")
    terms = {(shape, mesh): stage_cost_terms(workload, _hardware(4, mesh), shape, efficiency, software)
             for shape in (pairs, quads) for mesh in (False, True)}
    assert 2.5 < terms[pairs, True].dp_sync_ms(1e9) / terms[pairs, False].dp_sync_ms(1e9) <= 3.0
    assert terms[quads, True].dp_sync_ms(1e9) == terms[quads, False].dp_sync_ms(1e9)


def _sync_ms(model: str, shape: ParallelShape, mesh: bool, zero_stage: int = 1, ranks: int | None = None) -> float:
    terms = stage_cost_terms(Workload(model_preset(model), 4096, 256, zero_stage=zero_stage), _hardware(4, mesh), shape,
                             builtin_efficiency(H200), SoftwareConfig())
    return terms.dp_sync_ms(1e9, ranks)


def test_a_collective_over_two_peers_costs_the_same_whatever_shape_priced_it():
    # The planner prices syncs over other replica counts than the shape's (non-uniform replicas): the links are
    # those of the group synced, two GPUs of a node here, a third of each GPU's NVLink.
    costs = [_sync_ms("llama3-8b", ParallelShape(tp=1, pp=1, dp=dp, micro_batch_size=1, recompute="full"), True,
                      ranks=2) for dp in (1, 2, 4)]
    assert costs[0] == costs[1] == costs[2]
    switch = _sync_ms("llama3-8b", ParallelShape(tp=1, pp=1, dp=4, micro_batch_size=1, recompute="full"), False, ranks=2)
    assert 2.5 < costs[0] / switch <= 3.0


def test_experts_and_hybrid_shard_groups_sync_over_their_own_peer_links():
    # qwen3-30b-a3b, ep 2 over 4 replicas of a node: the experts (most of a layer's weights) sync between the two
    # replicas holding the same ones, over one peer's links; the rest over all four, over every link.
    experts = ParallelShape(tp=1, pp=1, dp=4, micro_batch_size=1, recompute="full", ep=2)
    assert _sync_ms("qwen3-30b-a3b", experts, True) / _sync_ms("qwen3-30b-a3b", experts, False) > 2.5
    dense = replace(experts, ep=1)
    assert _sync_ms("qwen3-30b-a3b", dense, True) == _sync_ms("qwen3-30b-a3b", dense, False)
    # Hybrid sharding, shard groups of 2 replicas in a node: their reduce-scatter runs over one peer's links.
    hybrid = ParallelShape(tp=1, pp=1, dp=8, micro_batch_size=1, recompute="full", dp_shard=2)
    assert _sync_ms("llama3-8b", hybrid, True, zero_stage=3) > 1.5 * _sync_ms("llama3-8b", hybrid, False, zero_stage=3)


def test_switch_is_the_default():
    assert Hardware(H200, 4, 1.0, 1.0) == replace(_hardware(4, False), intra_node_bandwidth_gb_s=1.0,
                                                   inter_node_bandwidth_gb_s=1.0)


def _moe_layer(mesh: bool, shape: ParallelShape, dispatcher: str = "alltoall"):
    workload = Workload(model_preset("mixtral-8x7b"), 4096, 64, zero_stage=1)
    return part_costs(workload, _hardware(4, mesh), shape, builtin_efficiency(H200),
                      SoftwareConfig(moe_dispatcher=dispatcher)).layer.time


def test_expert_tp_pairs_gather_their_tokens_over_one_peers_links():
    # TP 4 drives every link of a 4-GPU mesh, but experts split over expert-TP 2 gather and reduce-scatter their
    # routed tokens between two GPUs: over a third of the links, where a switch gives them all.
    split = ParallelShape(tp=4, pp=1, dp=2, micro_batch_size=1, recompute="full", ep=2, etp=2)
    assert _moe_layer(True, split).forward_tp_comm_ms > _moe_layer(False, split).forward_tp_comm_ms
    whole = replace(split, ep=1, etp=None)  # expert-TP = TP 4: every collective over every link
    assert _moe_layer(True, whole).forward_tp_comm_ms == _moe_layer(False, whole).forward_tp_comm_ms


def test_the_flex_dispatcher_reaches_every_expert_tp_shard_of_its_ep_peers():
    # tp 2, ep 2 in a node of 4: a GPU's tokens go to both shards of each expert, its EP peer's TP pair and its own
    # partner: all three peers, all of its links, as through a switch.
    shape = ParallelShape(tp=2, pp=1, dp=2, micro_batch_size=1, recompute="full", ep=2)
    mesh, switch = _moe_layer(True, shape, "flex"), _moe_layer(False, shape, "flex")
    assert switch.forward_ep_comm_ms > 0 and mesh.forward_ep_comm_ms == switch.forward_ep_comm_ms
    # Megatron's all-to-all reaches only the EP peer of the same TP rank: one peer's links.
    assert _moe_layer(True, shape).forward_ep_comm_ms > 2.5 * _moe_layer(False, shape).forward_ep_comm_ms


def test_a_replicate_only_hybrid_sync_runs_over_its_own_pair():
    # Hybrid sharding with shard groups of one replica: the two replicas all-reduce over one peer's links.
    replicated = ParallelShape(tp=1, pp=2, dp=2, micro_batch_size=1, recompute="full", dp_shard=1)
    assert _sync_ms("llama3-8b", replicated, True, zero_stage=3) > 2.5 * _sync_ms("llama3-8b", replicated, False,
                                                                                 zero_stage=3)
