"""Expert parallelism: a mixture of experts' routed experts split over `ep` data-parallel replicas.

Layout (Megatron-core's expert mesh with `--expert-tensor-parallel-size` unset, so expert-TP = TP, and
rank order tp-cp-ep-dp-pp: megatron/core/parallel_state.py `initialize_model_parallel`): the EP group of a
GPU is the GPUs of the same stage and TP rank in `ep` consecutive replicas. Each holds num_experts / ep
of the stage's routed experts, every expert sharded over TP as a dense MLP is; attention, router, norms
and shared experts stay replicated across the EP group. Expert gradients are reduced over the dp / ep
replicas holding the same experts, the rest over all dp.

Time (Megatron's all-to-all token dispatcher, megatron/core/transformer/moe/token_dispatcher.py
`MoEAlltoAllTokenDispatcher`; GShard, Lepikhin et al. 2020, section 2.2): per MoE layer, each GPU sends
each of its tokens (1 / tp of the microbatch's, sequence parallel) to its k routed experts, (ep - 1) / ep
of them on other ranks, in one all-to-all before the experts (dispatch) and one after (combine); the
backward runs both again with the gradients. The all-to-alls wait for the router and the experts wait
for them: they are priced exposed (Megatron overlaps them only with shared experts,
`--moe-shared-expert-overlap`, left out). Peers in a node talk over NVLink, the rest over the network,
both at once: the slower of the two shares sets the time.

With the deduplicating dispatchers (`moe_dispatcher: "flex"`: Megatron's flex dispatcher over DeepEP's or
HybridEP's kernels; deepseek-ai/DeepEP README, "normal kernels ... asymmetric-domain bandwidth forwarding,
NVLink to RDMA"; DeepSeek-V3 report section 3.2.2), a token crosses the network once per remote node holding
at least one of its k experts, to the GPU of its own index there, which forwards it over NVLink to the experts'
GPUs: the network carries E[remote nodes hit] copies of each token where the all-to-all carries one per
remote expert, and NVLink every copy whose expert is not on the GPU it lands on. The k experts are distinct
and, load balanced, uniformly chosen: a node holding e of the E experts is missed with probability
C(E - e, k) / C(E, k).

What is priced conservatively, and why the plan is then never optimistic: the optimizer state and the
gradient sync of the replicated weights are costed as if they, like the experts, were sharded over
and reduced among only dp / ep replicas (`expert_data_parallel`), which overstates their memory by at
most their share of the layer's state (3% for Mixtral-8x7B) and their sync by a ring's (n - 1) / n.
Expert load is taken as balanced (the auxiliary loss's aim); imbalance is not modelled.
"""

from __future__ import annotations

from math import comb

from cost_models.compute import BYTES_PER_ELEMENT
from cost_models.model_spec import ModelSpec

# A dispatch and a combine per MoE layer in the forward; the backward sends the gradients of both.
ALL_TO_ALLS_PER_PASS = 2


def expert_parallel_sizes(model: ModelSpec, dp: int, most: int | None = None) -> list[int]:
    """EP sizes a layout of `dp` replicas can use: divisors of both the replicas and the routed experts, at
    most `most` (1 alone for a dense model)."""
    if not model.is_moe:
        return [1]
    top = dp if most is None else min(dp, most)
    return [ep for ep in range(1, top + 1) if dp % ep == 0 and model.num_experts % ep == 0]


def layer_params_per_gpu(model: ModelSpec, tp: int, ep: int) -> float:
    """One layer's weights on one GPU: all of it over TP, the routed experts over EP as well; with dense layers
    among the expert ones, the larger of the two kinds (a stage may hold either)."""
    expert_layer = (model.params_per_layer - model.routed_expert_params_per_layer * (1 - 1 / ep)) / tp
    return max(expert_layer, model.dense_layer_params / tp)


def expert_data_parallel(grad_sync_ranks: int, ep: int) -> int:
    """Ranks among which the experts' gradients are reduced and their optimizer state sharded."""
    return max(1, grad_sync_ranks // ep)


ALL_TO_ALL, FLEX = "alltoall", "flex"


def remote_nodes_hit(num_experts: int, experts_per_token: int, ep: int, in_node: int) -> float:
    """Expected nodes other than the sender's that hold at least one of a token's k distinct, uniformly chosen
    experts: the EP group's ep ranks over ceil(ep / in_node) nodes, each rank num_experts / ep experts."""
    per_rank = num_experts // ep
    nodes, last = divmod(ep, in_node)
    sizes = [in_node] * nodes + ([last] if last else [])
    total, k = comb(num_experts, experts_per_token), experts_per_token
    # The sender's node is a full one; any other node is hit unless all k experts lie elsewhere.
    return sum(1 - comb(num_experts - size * per_rank, k) / total for size in sizes[1:])


def all_to_all_ms(model: ModelSpec, tokens: float, tp: int, ep: int, ranks_per_node: int,
                  intra_gb_s: float, inter_gb_s: float, dispatcher: str = ALL_TO_ALL) -> float:
    """One all-to-all of a layer's routed tokens (dispatch or combine) on one GPU: 0 without EP."""
    if ep <= 1 or not model.is_moe:
        return 0.0
    # Per mean layer: dense layers among the expert ones send nothing.
    token_bytes = tokens / tp * model.hidden_size * BYTES_PER_ELEMENT * model.expert_layers / model.num_layers
    routed_bytes = token_bytes * model.experts_per_token
    in_node = min(ep, max(1, ranks_per_node))
    if dispatcher == FLEX:
        intra_bytes = routed_bytes * (in_node - 1) / in_node
        inter_bytes = token_bytes * remote_nodes_hit(model.num_experts, model.experts_per_token, ep, in_node)
    else:
        intra_bytes = routed_bytes * (in_node - 1) / ep
        inter_bytes = routed_bytes * (ep - in_node) / ep
    return 1e3 * max(intra_bytes / (intra_gb_s * 1e9), inter_bytes / (inter_gb_s * 1e9))


def layer_all_to_all_ms(model: ModelSpec, tokens: float, tp: int, ep: int, ranks_per_node: int,
                        intra_gb_s: float, inter_gb_s: float, dispatcher: str = ALL_TO_ALL) -> float:
    """A pass's (forward's or backward's) all-to-alls of one layer."""
    return ALL_TO_ALLS_PER_PASS * all_to_all_ms(model, tokens, tp, ep, ranks_per_node, intra_gb_s, inter_gb_s,
                                                dispatcher)
