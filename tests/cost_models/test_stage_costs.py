"""Stage cost terms, stage memory and the iteration estimate, composed by hand
from the per-part times (which test_compute.py checks against first principles)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from cost_models.comm import NETWORK_STEP_LATENCY_S, NVLINK_STEP_LATENCY_S
from cost_models.efficiency import EfficiencyParams, SoftwareConfig
from cost_models.hardware import GpuSpec
from cost_models.iteration import (
    estimate_iteration,
    exposed_dp_sync_ms,
    exposed_param_gather_ms,
    stage_backward_ms,
    stage_time,
    stage_total_ms,
)
from cost_models.layout import Hardware, ParallelShape, Workload
from cost_models.memory import ACTIVATION_FRAGMENTATION
from cost_models.model_spec import ModelSpec
from cost_models.stage_costs import (
    max_layers_fitting,
    max_layers_fitting_all,
    pipeline_p2p_ms,
    stage_cost_terms,
    stage_memory_bytes,
)

GIB = 1024**3
GPU = GpuSpec("test-gpu", peak_tflops=100.0, memory_gib=80.0, hbm_bandwidth_gb_s=1000.0,
              intra_node_bandwidth_gb_s=200.0, inter_node_bandwidth_gb_s=25.0)
HW = Hardware(gpu=GPU, gpus_per_node=8, intra_node_bandwidth_gb_s=200.0, inter_node_bandwidth_gb_s=25.0)
EFF = EfficiencyParams(gemm_peak_fraction=0.5, gemm_half_width=64.0, hbm_fraction=0.5,
                       nvlink_fraction=0.75, network_fraction=0.8, layer_overhead_ms=0.1)
NVLINK_BPS = 200.0 * 0.75 * 1e9  # achieved NVLink bytes/s
NET_BPS = 25.0 * 0.8 * 1e9  # achieved network bytes/s
HBM_BPS = 1000.0 * 0.5 * 1e9
# activations are charged (1 + fragmentation) for the caching allocator; a named
# model parameter, used here as an input
FRAG = 1 + ACTIVATION_FRAGMENTATION

SW = SoftwareConfig(flash_attention=True, sequence_parallel=True, dropout=False, overlap_grad_reduce=False,
                    overlap_param_gather=False, grad_reduce_bytes=4)
SW_OVERLAP = SoftwareConfig(flash_attention=True, sequence_parallel=True, dropout=False, overlap_grad_reduce=True,
                            grad_reduce_bytes=4, ddp_bucket_params=10_000_000)

H, A, V, L = 1024, 16, 32000, 4
MODEL = ModelSpec("gpt-small", L, H, 4 * H, A, A, V, swiglu=False, tied_embeddings=False)
TIED = ModelSpec("gpt-small-tied", L, H, 4 * H, A, A, V, swiglu=False, tied_embeddings=True)
S, G = 512, 16
P_LAYER = 12 * H**2 + 2 * H  # 4h^2 attention + 8h^2 MLP + two norms


def terms_for(tp, pp, dp, mbs=2, recompute="none", software=SW, model=MODEL, zero=1, hw=HW, **kw):
    shape = ParallelShape(tp=tp, pp=pp, dp=dp, micro_batch_size=mbs, recompute=recompute, **kw)
    return stage_cost_terms(Workload(model, S, G, zero), hw, shape, EFF, software)


def fb(part):
    return part.time.forward_ms + part.time.backward_ms


def test_pp1_iteration_by_hand():
    tp, dp, mbs = 2, 2, 2
    terms = terms_for(tp, 1, dp, mbs)
    m = G // (dp * mbs)  # 4 microbatches per replica
    assert terms.num_microbatches == m
    assert terms.p2p_ms == 0.0  # no pipeline, no sends
    # one microbatch: all layers fwd+bwd, plus the embedding and the head
    per_microbatch = L * fb(terms.layer) + fb(terms.embedding) + fb(terms.head)
    # params per GPU: layers and both vocab matrices split over tp, plus the final norm
    params = L * P_LAYER / tp + V * H / tp + V * H / tp + H
    # dp = 2 groups of tp = 2 fit in one 8-GPU node: rings over NVLink. ZeRO-1: reduce-scatter of the
    # 4-byte gradients after the backward, then all-gather of the 2-byte updated weights after the step, each
    # (dp - 1) transfers of 1/dp of the buffer (each priced with an all-reduce's 2 (dp - 1) latencies).
    grad_bytes, weight_bytes = 4 * params, 2 * params
    dp_ms = sum(1e3 * ((dp - 1) / dp * size / NVLINK_BPS + 2 * (dp - 1) * NVLINK_STEP_LATENCY_S)
                for size in (grad_bytes, weight_bytes))
    # Adam: 34 bytes per param over HBM, sharded over dp by ZeRO-1
    opt_ms = 1e3 * params * 34 / dp / HBM_BPS
    est = estimate_iteration(terms, [L])
    assert est.stages[0].params == pytest.approx(params, rel=1e-12)
    assert est.pipeline_ms == pytest.approx(m * per_microbatch, rel=1e-12)
    assert est.dp_exposed_ms == pytest.approx(dp_ms, rel=1e-12)
    assert est.optimizer_ms == pytest.approx(opt_ms, rel=1e-12)
    assert est.iteration_ms == pytest.approx(m * per_microbatch + dp_ms + opt_ms, rel=1e-12)
    assert sum(est.breakdown_s.values()) == pytest.approx(est.iteration_ms / 1e3, rel=1e-12)


def test_dp_across_nodes_uses_network():
    tp, dp = 8, 2  # one TP group fills a node, so DP peers are on different nodes
    terms = terms_for(tp, 1, dp, 1, zero=0)  # ZeRO-0: an all-reduce of the gradients
    params = L * P_LAYER / tp + 2 * V * H / tp + H
    grad_bytes = 4 * params
    expected = 1e3 * (2 * (dp - 1) / dp * grad_bytes / NET_BPS + 2 * (dp - 1) * NETWORK_STEP_LATENCY_S)
    assert estimate_iteration(terms, [L]).dp_exposed_ms == pytest.approx(expected, rel=1e-12)


def test_overlapped_dp_sync_exposes_max_of_remainder_and_last_bucket():
    tp, dp = 2, 2
    terms = terms_for(tp, 1, dp, 2, software=SW_OVERLAP, zero=0)
    params = L * P_LAYER / tp + 2 * V * H / tp + H  # 57,938,944 > one 10M bucket
    full_ms = 1e3 * (grad_bytes := 4 * params) / NVLINK_BPS + 1e3 * 2 * NVLINK_STEP_LATENCY_S
    bucket_ms = 1e3 * 4 * 10_000_000 / NVLINK_BPS + 1e3 * 2 * NVLINK_STEP_LATENCY_S
    assert grad_bytes > 4 * 10_000_000
    # the last microbatch's backward hides part of the all-reduce
    backward_ms = L * terms.layer.time.backward_ms + terms.embedding.time.backward_ms + terms.head.time.backward_ms
    expected = max(full_ms - backward_ms, bucket_ms)
    stage = stage_time(terms, 0, L)
    assert exposed_dp_sync_ms(terms, stage) == pytest.approx(expected, rel=1e-12)
    # no data parallelism: nothing to sync
    assert estimate_iteration(terms_for(tp, 1, 1, 2), [L]).dp_exposed_ms == 0.0


def test_the_weight_all_gather_overlaps_the_next_forward_with_zero1():
    """Megatron's --overlap-param-gather: ZeRO-1's all-gather of the updated weights runs bucket by bucket under
    the next iteration's first forward; what the forward cannot cover, and at least the first bucket, is exposed.
    Without it the all-gather follows the optimizer step in full. ZeRO-0 has none."""
    tp, dp = 2, 2
    params = L * P_LAYER / tp + 2 * V * H / tp + H
    gather_ms = 1e3 * (2 * params) / 2 / NVLINK_BPS + 1e3 * 2 * NVLINK_STEP_LATENCY_S  # 2-byte weights, 1/2 each
    bucket_ms = 1e3 * (2 * 10_000_000) / 2 / NVLINK_BPS + 1e3 * 2 * NVLINK_STEP_LATENCY_S
    reduce_ms = 1e3 * (4 * params) / 2 / NVLINK_BPS + 1e3 * 2 * NVLINK_STEP_LATENCY_S  # 4-byte gradients
    reduce_bucket_ms = 1e3 * (4 * 10_000_000) / 2 / NVLINK_BPS + 1e3 * 2 * NVLINK_STEP_LATENCY_S
    terms = terms_for(tp, 1, dp, 2, software=SW_OVERLAP, zero=1)
    stage = stage_time(terms, 0, L)
    forward_ms = L * terms.layer.time.forward_ms + terms.embedding.time.forward_ms + terms.head.time.forward_ms
    backward_ms = L * terms.layer.time.backward_ms + terms.embedding.time.backward_ms + terms.head.time.backward_ms
    exposed_gather = max(gather_ms - forward_ms, bucket_ms)
    assert exposed_param_gather_ms(terms, stage) == pytest.approx(exposed_gather, rel=1e-12)
    expected = max(reduce_ms - backward_ms, reduce_bucket_ms) + exposed_gather
    assert exposed_dp_sync_ms(terms, stage) == pytest.approx(expected, rel=1e-12)
    assert estimate_iteration(terms, [L]).dp_exposed_ms == pytest.approx(expected, rel=1e-12)
    after_step = terms_for(tp, 1, dp, 2, software=replace(SW_OVERLAP, overlap_param_gather=False), zero=1)
    assert exposed_param_gather_ms(after_step, stage_time(after_step, 0, L)) == pytest.approx(gather_ms, rel=1e-12)
    zero0 = terms_for(tp, 1, dp, 2, software=SW_OVERLAP, zero=0)
    assert exposed_param_gather_ms(zero0, stage_time(zero0, 0, L)) == 0.0


def test_stage_memory_by_hand_pp1():
    tp, dp, mbs = 2, 2, 2
    terms = terms_for(tp, 1, dp, mbs)
    state = 6 + 12 / dp  # ZeRO-1
    # Korthikanti TP+SP without dropout masks, flash attention: 32 s b h / t
    act_layer = 32 * S * mbs * H / tp
    act_embedding = 2 * S * mbs * H / tp
    act_head = 4 * S * mbs * V / tp  # fp32 logits
    fixed_params = V * H / tp + V * H / tp + H
    for n in (0, 1, 3, 10):
        activations = n * act_layer + act_embedding + act_head  # one microbatch in flight
        expected = (n * P_LAYER / tp + fixed_params) * state + activations * FRAG
        assert stage_memory_bytes(terms, 0, n) == pytest.approx(expected, rel=1e-12)


def test_stage_memory_affine_in_layers_pp4():
    tp, pp, dp, mbs = 2, 4, 1, 1
    terms = terms_for(tp, pp, dp, mbs)  # m = 16 microbatches
    # 1F1B: stage i keeps p - i microbatches of activations in flight (m = 16 >= p)
    state = 18.0  # dp = 1: nothing to shard
    act_layer = 32 * S * mbs * H / tp
    for stage in range(pp):
        per_layer = P_LAYER / tp * state + act_layer * (pp - stage) * FRAG
        base = stage_memory_bytes(terms, stage, 0)
        for n in (1, 5, 20):
            assert stage_memory_bytes(terms, stage, n) - base == pytest.approx(n * per_layer, rel=1e-12)
    # only the first stage holds the embedding, only the last the head
    assert stage_memory_bytes(terms, 1, 0) == 0.0  # the memory reserve is the planner's, not the stage's
    assert stage_memory_bytes(terms, 0, 0) == pytest.approx(
        V * H / tp * state + 2 * S * mbs * H / tp * 4 * FRAG, rel=1e-12
    )
    assert stage_memory_bytes(terms, 3, 0) == pytest.approx(
        (V * H / tp + H) * state + 4 * S * mbs * V / tp * FRAG, rel=1e-12
    )


def test_tied_head_shares_weights_only_without_pipeline():
    tp = 2
    pp1 = terms_for(tp, 1, 1, model=TIED)
    pp2 = terms_for(tp, 2, 1, model=TIED)
    assert pp1.head.params == H  # only the final norm
    assert pp2.head.params == pytest.approx(V * H / tp + H, rel=1e-12)  # last stage keeps a copy


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_max_layers_fitting(stage):
    tp, pp, dp, mbs = 2, 4, 1, 1
    terms = terms_for(tp, pp, dp, mbs)
    memory = 80 * GIB
    state = 18.0
    per_layer = P_LAYER / tp * state + 32 * S * mbs * H / tp * (pp - stage) * FRAG
    fixed = stage_memory_bytes(terms, stage, 0)
    expected = math.floor((memory - fixed) / per_layer)
    n = max_layers_fitting(terms, stage, memory)
    assert n == expected
    assert n > 0
    assert stage_memory_bytes(terms, stage, n) <= memory
    assert stage_memory_bytes(terms, stage, n + 1) > memory


def test_max_layers_fitting_when_nothing_fits():
    terms = terms_for(2, 1, 1)
    assert max_layers_fitting(terms, 0, 0.5 * GIB) < 1  # less than the embedding and head's state


def test_p2p_within_and_across_nodes():
    tp, pp, mbs = 2, 2, 2
    p2p_bytes = 2 * S * mbs * H / tp  # bf16 activation, scattered over the TP group
    # tp * pp * dp = 8 GPUs: one node, NVLink; one send forward and one back per microbatch
    inside = terms_for(tp, pp, 2, mbs)
    assert inside.p2p_ms == pytest.approx(2 * 1e3 * (p2p_bytes / NVLINK_BPS + NVLINK_STEP_LATENCY_S), rel=1e-12)
    # 16 GPUs: pipeline neighbours cross the network
    across = terms_for(tp, pp, 4, 1)
    p2p_bytes_1 = 2 * S * 1 * H / tp
    assert across.p2p_ms == pytest.approx(2 * 1e3 * (p2p_bytes_1 / NET_BPS + NETWORK_STEP_LATENCY_S), rel=1e-12)
    # interleaving with v chunks multiplies the transfers by v
    v3 = terms_for(tp, pp, 2, mbs, schedule="interleaved", virtual_stages=3)
    assert v3.p2p_ms == pytest.approx(3 * inside.p2p_ms, rel=1e-12)


def test_slow_stage_doubles_compute_only():
    terms = terms_for(2, 2, 2, 2)
    fast = stage_time(terms, 0, 2, 1.0)
    slow = stage_time(terms, 0, 2, 0.5)
    # compute by hand from the parts: two layers + embedding
    compute = 2 * (terms.layer.time.forward_compute_ms + terms.layer.time.backward_compute_ms) + (
        terms.embedding.time.forward_compute_ms + terms.embedding.time.backward_compute_ms
    )
    comm = 2 * (terms.layer.time.forward_tp_comm_ms + terms.layer.time.backward_tp_comm_ms) + (
        terms.embedding.time.forward_tp_comm_ms + terms.embedding.time.backward_tp_comm_ms
    )
    assert comm > 0 and terms.p2p_ms > 0
    assert fast.compute_ms == pytest.approx(compute, rel=1e-12)
    assert fast.total_ms == pytest.approx(compute + comm + terms.p2p_ms, rel=1e-12)
    assert slow.compute_ms == pytest.approx(2 * compute, rel=1e-12)
    assert slow.tp_comm_ms == pytest.approx(comm, rel=1e-12)
    assert slow.p2p_ms == pytest.approx(terms.p2p_ms, rel=1e-12)
    assert slow.total_ms == pytest.approx(2 * compute + comm + terms.p2p_ms, rel=1e-12)


def test_pp2_iteration_with_slow_stage():
    terms = terms_for(2, 2, 2, 2)  # m = 4
    m = 4
    layer_c = terms.layer.time.forward_compute_ms + terms.layer.time.backward_compute_ms
    layer_x = terms.layer.time.forward_tp_comm_ms + terms.layer.time.backward_tp_comm_ms
    emb_c = terms.embedding.time.forward_compute_ms + terms.embedding.time.backward_compute_ms
    emb_x = terms.embedding.time.forward_tp_comm_ms + terms.embedding.time.backward_tp_comm_ms
    head_c = terms.head.time.forward_compute_ms + terms.head.time.backward_compute_ms
    # stage 0: 2 layers + embedding at half speed; stage 1: 2 layers + head at full speed
    t0 = (2 * layer_c + emb_c) / 0.5 + 2 * layer_x + emb_x + terms.p2p_ms
    t1 = 2 * layer_c + head_c + 2 * layer_x + terms.p2p_ms
    est = estimate_iteration(terms, [2, 2], [0.5, 1.0])
    # m * max + (sum - max), v = 1
    slowest = max(t0, t1)
    assert est.pipeline_ms == pytest.approx(m * slowest + (t0 + t1 - slowest), rel=1e-12)
    assert est.bottleneck_stage == (0 if t0 > t1 else 1)


@pytest.mark.parametrize("schedule,virtual_stages", [("1f1b", 1), ("interleaved", 2)])
def test_search_shortcuts_equal_the_full_stage_figures(schedule, virtual_stages):
    """The planner's search reads stage totals, backwards and whole rows of caps through shortcuts
    that skip the rest; they must be the very same numbers, bit for bit."""
    terms = terms_for(2, 4, 2, schedule=schedule, virtual_stages=virtual_stages)
    for stage in range(4):
        for layers in (0, 1, 3):
            for speed in (1.0, 0.5, 0.3):
                full = stage_time(terms, stage, layers, speed)
                assert stage_total_ms(terms, stage, layers, speed) == full.total_ms
                assert stage_backward_ms(terms, stage, layers, speed) == full.backward_ms
    assert max_layers_fitting_all(terms, 80 * GIB) == tuple(max_layers_fitting(terms, s, 80 * GIB) for s in range(4))


@pytest.mark.parametrize("schedule,virtual_stages", [("1f1b", 1), ("interleaved", 2), ("interleaved", 4), ("gpipe", 1)])
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dp", [1, 2, 16])
def test_cap_rows_equal_the_per_stage_caps(schedule, virtual_stages, pp, dp):
    """A row of caps reuses the first, middle and last stages' memory without layers and one
    in-flight row: the same numbers, bit for bit, as asking stage by stage (m < p included)."""
    if schedule == "interleaved" and pp == 1:
        return
    terms = terms_for(1, pp, dp, mbs=1, schedule=schedule, virtual_stages=virtual_stages)
    for memory_gib in (1, 8, 80):
        row = max_layers_fitting_all(terms, memory_gib * GIB)
        assert row == tuple(max_layers_fitting(terms, s, memory_gib * GIB) for s in range(pp))
    assert terms.in_flight_row() == [terms.in_flight(s) for s in range(pp)]


@pytest.mark.parametrize("tp,pp,dp", [(1, 2, 1), (2, 4, 1), (2, 4, 2), (8, 2, 1), (1, 1, 4)])
def test_pipeline_p2p_is_the_terms_p2p(tp, pp, dp):
    for virtual_stages in (1, 2):
        schedule = "interleaved" if virtual_stages > 1 else "1f1b"
        terms = terms_for(tp, pp, dp, schedule=schedule, virtual_stages=virtual_stages)
        assert pipeline_p2p_ms(Workload(MODEL, S, G, 1), HW, terms.shape, EFF, SW) == terms.p2p_ms


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "looped-bfs", "optimized"])
def test_layer_caps_outline_is_the_whole_rows_first_last_and_roomiest_middle(schedule):
    """The outline reads three stages only, relying on microbatches in flight never rising from stage to
    stage; the whole row (`max_layers_fitting_all`) says whether it holds, for every pipeline length and
    microbatch count tried."""
    from cost_models.stage_costs import layer_caps_outline

    chunked = schedule in ("interleaved", "looped-bfs")
    checked = 0
    for pp in range(1, 9):
        for dp in (1, 2, 4, 8):
            if G % dp:
                continue
            for v in ((2, 4) if chunked else (1,)):
                terms = terms_for(1, pp, dp, mbs=1, schedule=schedule, virtual_stages=v)
                for memory_gib in (8, 20, 40):
                    row = max_layers_fitting_all(terms, memory_gib * GIB)
                    expected = (row[0], row[-1], max(row[1:-1]) if pp > 2 else None)
                    assert layer_caps_outline(terms, memory_gib * GIB) == expected, (pp, dp, v, memory_gib)
                    checked += 1
    assert checked > 50
