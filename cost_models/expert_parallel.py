"""Expert parallelism: a mixture of experts' routed experts split over `ep` GPUs of a stage.

Layout (Megatron-core's expert mesh, rank order etp-ep-edp over a stage's tp x cp x dp ranks, dense order
tp-cp-dp: megatron/core/parallel_state.py `initialize_model_parallel`, `expert_decoder_rank_generator`): each
routed expert is split over `etp` ranks (`--expert-tensor-parallel-size`, default tp) and the experts over
`ep` ranks, so an EP group is `ep` GPUs of one stage, `etp` apart, over ep x etp / tp consecutive TP groups,
a replica's CP ranks first, then replicas (`ParallelShape.expert_span`, `expert_replicas`; with etp = tp and
cp 1, the same TP rank of ep replicas). Each holds num_experts / ep
of the stage's routed experts, 1 / etp of each; attention, router, norms and shared experts stay split over
TP and replicated across the EP group. Expert gradients are reduced over the dp x cp / expert_span TP groups
holding the same experts, the rest over all dp x cp. Expert-TP below TP changes no GPU's FLOPs or expert memory
(tp / etp TP ranks' routed tokens on wider expert shards): it trades the expert-TP group's all-gather and
reduce-scatter of routed tokens (`cost_models.compute.mlp_tp_comm_ms`) for wider GEMMs and more GPUs in the
all-to-all.

Time (Megatron's all-to-all token dispatcher, megatron/core/transformer/moe/token_dispatcher.py
`MoEAlltoAllTokenDispatcher`; GShard, Lepikhin et al. 2020, section 2.2): per MoE layer, each GPU sends
each of its tokens (1 / (tp cp) of the microbatch's: sequence and context parallel) to its k routed experts, (ep - 1) / ep
of them on other ranks, in one all-to-all before the experts (dispatch) and one after (combine); the
backward runs both again with the gradients. The all-to-alls wait for the router and the experts wait
for them: they are priced exposed (Megatron's overlap with shared experts, `--moe-shared-expert-overlap`, is
left out), unless Megatron's batch-level EP overlap pairs one microbatch's forward with another's backward
(`SoftwareConfig.moe_a2a_overlap`, `overlapped_all_to_all_ms`). Peers in a node talk over NVLink, the rest over the network,
both at once: the slower of the two shares sets the time.

With the deduplicating dispatchers (`moe_dispatcher: "flex"`: Megatron's flex dispatcher over DeepEP's or
HybridEP's kernels; deepseek-ai/DeepEP README, "normal kernels ... asymmetric-domain bandwidth forwarding,
NVLink to RDMA"; DeepSeek-V3 report section 3.2.2), a token crosses the network once per remote node holding
at least one of its k experts, to the GPU of its own index there, which forwards it over NVLink to the other
GPUs of that node holding any of its experts: the network carries E[remote nodes hit] copies of each token
where the all-to-all carries one per remote expert, and NVLink one per GPU hit besides the one it lands on
(token-based dispatch: a GPU holding several of a token's experts gets it once; NVIDIA, "Scalable Training of
Mixture-of-Experts Models with Megatron Core", arXiv 2603.07685, section 4.2.2). The k experts are distinct
and, load balanced, uniformly chosen: a set of GPUs holding e of the E experts is missed with probability
C(E - e, k) / C(E, k).

Measured against that report's Table 7 (H100, hidden 7168, 4,096 tokens, 256 experts: dispatch and combine
latencies of Megatron's all-to-all and of HybridEP at EP 8-64; `benchmarks/calibration/megatron_core_moe_table7.json`,
`python -m benchmarks.ep_dispatch`), these prices come out 0.7-1.4x the published times: bandwidth alone,
no per-message latency or kernel overheads.

State: Megatron's DDP keeps two gradient buffers, the experts' reduced (and, with the distributed optimizer,
sharded) over the expert data-parallel ranks, dp x cp / (ep x etp / tp) TP groups (`expert_data_parallel`),
the rest over all dp x cp ranks (megatron/core/distributed/distributed_data_parallel.py: dense parameters over
`get_data_parallel_group(with_context_parallel=True)`, expert parameters over
`get_expert_data_parallel_group()`). Memory counts each at its own ranks (`layer_state_bytes_per_gpu`);
before 2026-12-05 the replicated weights were counted as sharded like the experts, which put Qwen3-30B-A3B's
published 16-GPU FP8 run (tp 1, ep 16: expert data parallelism 1) at 88.6 GiB, its attention, norms, router
and 0.6B-parameter embedding and head each holding 18 bytes per parameter where the distributed optimizer
leaves 6.8.

The data-parallel collectives follow the same two groups (`StageCostTerms.dp_sync_ms`, `param_gather_ms` and
ZeRO-2/3's per-microbatch ones): the experts' share of a layer's weights (`expert_param_share`) over the expert
data-parallel ranks, every `expert_span`-th TP group, so fewer of them share a node (`expert_sync_group`); the
rest, embedding and head included, over all dp x cp. With hybrid sharding both groups are taken inside the shard
group (`cost_models.sharded_dp`). Both go under the same backward, one after the other, as
Megatron's two buffers' buckets do. Before 2026-12-05 a stage's whole sync ran over dp x cp: with ep 8 on 8-GPU
nodes that put seven of eight expert data-parallel peers in the node and divided the experts' network traffic
by eight. Two approximations, both small: a stage's embedding and head sync at the layers' mix (`dp_sync_ms`
takes a parameter count, which the layer split keeps affine), and the optimizer step of the embedding and head
at the layer's mix. Expert load is taken as balanced (the auxiliary loss's aim); imbalance is not modelled.
"""

from __future__ import annotations

from math import comb

from cost_models.compute import BYTES_PER_ELEMENT
from cost_models.efficiency import ALL_TO_ALL, FLEX
from cost_models.model_spec import ModelSpec

# A dispatch and a combine per MoE layer in the forward; the backward sends the gradients of both.
ALL_TO_ALLS_PER_PASS = 2


def expert_layouts(model: ModelSpec, tp: int, dp: int, most: int | None = None,
                   cp: int = 1) -> list[tuple[int, int | None]]:
    """(ep, etp) pairs the search tries for `dp` replicas of TP `tp` and CP `cp`: expert-TP = TP (etp None,
    Megatron's default) and, with tp > 1, expert-TP 1 (what Megatron's MoE recipes set); for each, every ep of
    at most `most` that `expert_layout_problem` allows ((1, None) alone for a dense model). Other expert-TP
    sizes are estimated, not searched."""
    if not model.is_moe:
        return [(1, None)]
    out: list[tuple[int, int | None]] = [(1, None)]
    for etp in ((tp, 1) if tp > 1 else (tp,)):
        for ep in range(tp // etp, model.num_experts + 1, tp // etp):
            if (ep, etp) != (1, tp) and (most is None or ep <= most) and (
                    expert_layout_problem(model, tp, dp, ep, None if etp == tp else etp, cp) is None):
                out.append((ep, None if etp == tp else etp))
    return out


def expert_layout_problem(model: ModelSpec, tp: int, dp: int, ep: int, etp: int | None, cp: int = 1) -> str | None:
    """Why experts cannot be laid out as (ep, etp) over `dp` replicas of TP `tp` and CP `cp`, in a user's terms;
    None if they can: etp divides tp, ep divides the routed experts, and the EP group covers whole TP groups
    (tp / etp divides ep) that tile the stage's ranks in megatron-core's order, CP ranks of a replica first:
    its ep x etp / tp TP groups divide a replica's cp, or are whole replicas dividing dp."""
    expert_tp = tp if etp is None else etp
    if tp % expert_tp:
        return f"etp {expert_tp} must divide tp {tp}"
    if ep == 1 and expert_tp == tp:
        return None
    if not model.is_moe:
        return f"ep {ep}, etp {expert_tp} need a mixture-of-experts model; this one is dense"
    if ep % (tp // expert_tp):
        return (f"ep {ep} must be a multiple of tp / etp = {tp // expert_tp}: an EP group of etp-wide experts spans "
                f"whole TP groups")
    if model.num_experts % ep:
        return f"ep {ep} must divide the {model.num_experts} routed experts"
    span = ep * expert_tp // tp
    if cp % span == 0:
        return None
    if span % cp or dp % (span // cp):
        if cp > 1:
            return (f"ep {ep} with etp {expert_tp} spans {span} TP groups (ep x etp / tp): they must divide the {cp} "
                    f"CP ranks of a replica, or be whole replicas ({cp} each) whose count divides the {dp} replicas")
        return (f"ep {ep} with etp {expert_tp} spans {span} replicas (ep x etp / tp), which must divide the {dp} "
                "replicas")
    return None


def layer_params_per_gpu(model: ModelSpec, tp: int, ep: int, expert_tp: int | None = None) -> float:
    """One layer's weights on one GPU: the routed experts over ep x expert_tp ranks (expert-TP default tp), the
    rest over TP; with dense layers among the expert ones, the larger of the two kinds (a stage may hold either)."""
    routed = model.routed_expert_params_per_layer
    expert_layer = (model.params_per_layer - routed) / tp + routed / (ep * (tp if expert_tp is None else expert_tp))
    return max(expert_layer, model.dense_layer_params / tp)


def expert_param_share(model: ModelSpec, tp: int, ep: int, expert_tp: int | None = None) -> float:
    """Share of a layer's weights on one GPU (`layer_params_per_gpu`) that are routed experts: the share whose
    gradients sync over the expert data-parallel ranks (0 for a dense model)."""
    if not model.is_moe:
        return 0.0
    experts = model.routed_expert_params_per_layer / (ep * (tp if expert_tp is None else expert_tp))
    return experts / layer_params_per_gpu(model, tp, ep, expert_tp)


def expert_sync_group(ranks: int, span: int, groups_per_node: int) -> tuple[int, int]:
    """(ranks, ranks per node) of the expert data-parallel group among `ranks` TP groups holding the same
    replicated weights, `groups_per_node` of them per node: every `span`-th TP group holds the same experts
    (rank order etp-ep-edp), so a node holds groups_per_node / span of them, at least one."""
    expert_ranks = expert_data_parallel(ranks, span)
    return expert_ranks, min(expert_ranks, max(1, groups_per_node // span))


def layer_state_bytes_per_gpu(model: ModelSpec, tp: int, ep: int, expert_tp: int | None,
                              dense_bytes_per_param: float, expert_bytes_per_param: float) -> float:
    """One layer's weights, gradients and optimizer state on one GPU: the routed experts' at
    `expert_bytes_per_param` (sharded, with a distributed optimizer, over the expert data-parallel ranks), the
    rest at `dense_bytes_per_param` (over all data- and context-parallel ranks); with dense layers among the
    expert ones, the larger of the two kinds (`layer_params_per_gpu`)."""
    routed = model.routed_expert_params_per_layer
    experts = routed / (ep * (tp if expert_tp is None else expert_tp))
    expert_layer = (model.params_per_layer - routed) / tp * dense_bytes_per_param + experts * expert_bytes_per_param
    return max(expert_layer, model.dense_layer_params / tp * dense_bytes_per_param)


def expert_data_parallel(grad_sync_ranks: int, span: int) -> int:
    """Ranks (TP groups) among which the experts' gradients are reduced and their optimizer state sharded: the
    `grad_sync_ranks` holding the same dense weights over the `span` TP groups of an EP group
    (`ParallelShape.expert_span`)."""
    return max(1, grad_sync_ranks // span)


def _missed(num_experts: int, experts_per_token: int, held: int) -> float:
    """Probability that none of a token's k distinct, uniformly chosen experts is among `held` of them."""
    return comb(num_experts - held, experts_per_token) / comb(num_experts, experts_per_token)


def remote_nodes_hit(num_experts: int, experts_per_token: int, ep: int, in_node: int) -> float:
    """Expected nodes other than the sender's that hold at least one of a token's k distinct, uniformly chosen
    experts: the EP group's ep ranks over ceil(ep / in_node) nodes, each rank num_experts / ep experts."""
    per_rank = num_experts // ep
    nodes, last = divmod(ep, in_node)
    sizes = [in_node] * nodes + ([last] if last else [])
    # The sender's node is a full one; any other node is hit unless all k experts lie elsewhere.
    return sum(1 - _missed(num_experts, experts_per_token, size * per_rank) for size in sizes[1:])


def forwarded_gpus_hit(num_experts: int, experts_per_token: int, ep: int, in_node: int) -> float:
    """Expected GPUs of the EP group a token reaches over NVLink under token-based dispatch: every GPU holding
    one of its experts but the one it lands on in each node (the sender itself in its own node)."""
    nodes = -(-ep // in_node)
    return (ep - nodes) * (1 - _missed(num_experts, experts_per_token, num_experts // ep))


def all_to_all_ms(model: ModelSpec, tokens: float, tp: int, ep: int, ranks_per_node: int,
                  intra_gb_s: float, inter_gb_s: float, dispatcher: str = ALL_TO_ALL,
                  expert_tp: int | None = None) -> float:
    """One all-to-all of a layer's routed tokens (dispatch or combine) on one GPU: 0 without EP. `ranks_per_node`:
    the EP group's GPUs in one node. The flex dispatcher sends each routed copy to all `expert_tp` ranks of its
    expert over NVLink (Megatron's `MoEFlexTokenDispatcher` dispatches top-k x tp over the TP x EP group)."""
    if ep <= 1 or not model.is_moe:
        return 0.0
    # Per mean layer: dense layers among the expert ones send nothing.
    token_bytes = tokens / tp * model.hidden_size * BYTES_PER_ELEMENT * model.expert_layers / model.num_layers
    routed_bytes = token_bytes * model.experts_per_token
    in_node = min(ep, max(1, ranks_per_node))
    if dispatcher == FLEX:
        gpus = forwarded_gpus_hit(model.num_experts, model.experts_per_token, ep, in_node)
        intra_bytes = token_bytes * (tp if expert_tp is None else expert_tp) * gpus
        inter_bytes = token_bytes * remote_nodes_hit(model.num_experts, model.experts_per_token, ep, in_node)
    else:
        intra_bytes = routed_bytes * (in_node - 1) / ep
        inter_bytes = routed_bytes * (ep - in_node) / ep
    return 1e3 * max(intra_bytes / (intra_gb_s * 1e9), inter_bytes / (inter_gb_s * 1e9))


def layer_all_to_all_ms(model: ModelSpec, tokens: float, tp: int, ep: int, ranks_per_node: int,
                        intra_gb_s: float, inter_gb_s: float, dispatcher: str = ALL_TO_ALL,
                        expert_tp: int | None = None) -> float:
    """A pass's (forward's or backward's) all-to-alls of one layer."""
    return ALL_TO_ALLS_PER_PASS * all_to_all_ms(model, tokens, tp, ep, ranks_per_node, intra_gb_s, inter_gb_s,
                                                dispatcher, expert_tp)


def merged_share(pp: int, virtual_stages: int, microbatches: int) -> float:
    """Share of a stage's forward and backward ops Megatron's batch-level EP overlap merges into pairs: all
    but the warmup forwards (and as many cooldown backwards). Without pipelining the first forward and the
    last backward run alone; interleaved 1F1B warms up with (p - 1 - rank) 2 + (v - 1) p chunk forwards,
    (p - 1) + (v - 1) p on average over ranks (megatron/core/pipeline_parallel/schedules.py
    `get_pp_rank_microbatches`), of m v."""
    warmup = 1 if pp == 1 else (pp - 1) + (virtual_stages - 1) * pp
    return max(0.0, 1.0 - warmup / (microbatches * virtual_stages))


def a2a_overlap_applies(ep: int, pp: int, virtual_stages: int, recompute: str) -> bool:
    """Where megatron-core runs its batch-level EP overlap (`--overlap-moe-expert-parallel-comm`;
    TransformerConfig.__post_init__): expert parallelism, no full recompute, and one pipeline stage or an
    interleaved pipeline."""
    return ep > 1 and recompute != "full" and (pp == 1 or virtual_stages > 1)


def overlapped_all_to_all_ms(forward_ms: float, backward_ms: float, forward_compute_ms: float,
                             backward_compute_ms: float, mlp_forward_ms: float, mlp_backward_ms: float,
                             share: float) -> tuple[float, float]:
    """(forward, backward) all-to-all time left exposed per layer by Megatron's batch-level EP overlap
    (`--overlap-moe-expert-parallel-comm`, megatron/core/transformer/moe/README.md "EP A2A Overlap").

    The forward of one microbatch's layer and the backward of another's run as one step
    (megatron/core/models/common/model_chunk_schedule_plan.py, `TransformerLayerSchedulePlan.run`), the
    all-to-alls in order on a communication stream, the computation in order on the compute stream:

        communication: combine backward  | dispatch forward, dispatch backward      | combine forward
        computation:   attention forward | MLP backward, its weight gradients, MLP forward | attention backward

    each waiting for its input: the forward's dispatch for its attention (and router), its MLP for its
    dispatch, its combine for its MLP; the backward's MLP for its combine, its dispatch for its MLP, its
    attention for its dispatch (`_paired_layer_ms`). So an all-to-all hides only under the block of
    computation that runs beside it, not under the pair's whole computation. The MLP node is the routed
    experts and whatever runs between the dispatch and the combine on the compute stream (expert-TP collectives
    included: `mlp_forward_ms`, `mlp_backward_ms`, its input and weight gradients together:
    `--delay-wgrad-compute`, which lets the backward's dispatch start after the input gradients, is not
    modelled); "attention" is the rest of the layer's computation, shared experts included. Each pair ends when
    both streams have: the next pair's combine backward waits for this one's attention backward, its attention
    forward for this one's combine forward. Of the `share` of ops merged into pairs, what the pair takes beyond
    its computation stays exposed; the unmerged ops' all-to-alls stay whole. Both split between forward and
    backward as their all-to-alls are. Before 2026-12-06 the all-to-alls hid under as much of the pair's
    computation as there was: Qwen3-235B-A22B's published run (`benchmarks.fidelity`) priced 25% fast, now 19%.
    """
    total = forward_ms + backward_ms
    if total <= 0.0:
        return 0.0, 0.0
    mlp_forward_ms = min(mlp_forward_ms, forward_compute_ms)
    mlp_backward_ms = min(mlp_backward_ms, backward_compute_ms)
    paired_ms = _paired_layer_ms(forward_ms / ALL_TO_ALLS_PER_PASS, backward_ms / ALL_TO_ALLS_PER_PASS,
                                 forward_compute_ms - mlp_forward_ms, mlp_forward_ms, mlp_backward_ms,
                                 backward_compute_ms - mlp_backward_ms)
    # Never below zero, which rounding would otherwise give where the computation covers every block.
    exposed = max(0.0, share * (paired_ms - forward_compute_ms - backward_compute_ms) + (1 - share) * total)
    return forward_ms * exposed / total, backward_ms * exposed / total


def _paired_layer_ms(forward_a2a_ms: float, backward_a2a_ms: float, attention_forward_ms: float,
                     mlp_forward_ms: float, mlp_backward_ms: float, attention_backward_ms: float) -> float:
    """One merged forward-backward step of a layer (`overlapped_all_to_all_ms`): when both streams are done."""
    combine_backward_end = backward_a2a_ms
    attention_forward_end = attention_forward_ms
    ready = max(combine_backward_end, attention_forward_end)
    dispatch_forward_end = ready + forward_a2a_ms
    mlp_backward_end = ready + mlp_backward_ms  # input and weight gradients
    dispatch_backward_end = max(dispatch_forward_end, mlp_backward_end) + backward_a2a_ms
    mlp_forward_end = max(mlp_backward_end, dispatch_forward_end) + mlp_forward_ms
    combine_forward_end = max(dispatch_backward_end, mlp_forward_end) + forward_a2a_ms
    attention_backward_end = max(mlp_forward_end, dispatch_backward_end) + attention_backward_ms
    return max(combine_forward_end, attention_backward_end)
