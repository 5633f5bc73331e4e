"""Per-layer and per-end (embedding, head) cost terms of one parallel shape.

Every quantity a stage needs is affine in its layer count, so the planner
can put these coefficients straight into a linear CP-SAT model and the
evaluator (`iteration.py`) can use the very same numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

from cost_models.comm import (
    NETWORK_STEP_LATENCY_S,
    NVLINK_STEP_LATENCY_S,
    hierarchical_all_gather_s,
    hierarchical_all_reduce_s,
    point_to_point_s,
)
from cost_models.context_parallel import ring_link
from cost_models.choices import Recompute
from cost_models.compute import (
    LayerTime,
    embedding_time,
    gemm_time_s,
    head_time,
    layer_time,
    mlp_tp_comm_ms,
    routed_experts_forward_ms,
)
from cost_models.efficiency import FLEX, EfficiencyParams, SoftwareConfig
from cost_models.flops import BACKWARD_TO_FORWARD
from cost_models.expert_parallel import (
    a2a_overlap_applies,
    expert_data_parallel,
    expert_param_share,
    expert_sync_group,
    layer_all_to_all_ms,
    layer_params_per_gpu,
    layer_state_bytes_per_gpu,
    merged_share,
    overlapped_all_to_all_ms,
)
from cost_models.fp8 import WEIGHT_CACHE_BYTES_PER_PARAM as FP8_WEIGHT_CACHE_BYTES_PER_PARAM
from cost_models.hardware import GpuSpec
from cost_models.layout import Hardware, ParallelShape, Workload, nvlink_group_gb_s
from cost_models.model_spec import ModelSpec
from cost_models.sharded_dp import gathered_bytes_per_param, shards_every_microbatch, with_sharded_comm
from cost_models.memory import (
    ACTIVATION_FRAGMENTATION,
    embedding_activation_bytes,
    head_activation_bytes,
    in_flight_microbatches,
    in_flight_row,
    layer_activation_bytes,
    optimizer_bytes_per_param,
    state_bytes_per_param,
)

# Adam step traffic per parameter: read fp32 master, grad, m, v (16); write
# master, m, v (12), the bf16 weight (2) and zero the gradient (4).
ADAM_STEP_BYTES_PER_PARAM = 34.0
# Without master weights, all in bf16: read the weight, grad, m, v (8); write weight, m, v (6); zero the grad (2).
BF16_ADAM_STEP_BYTES_PER_PARAM = 16.0


@dataclass(frozen=True)
class PartCosts:
    """Costs of one part (a layer, the embedding or the head) on one GPU of its stage."""

    time: LayerTime
    params: float  # parameters held per GPU (already divided by tp)
    activation_bytes: float  # per in-flight microbatch
    cache_bytes: float = 0.0  # kept all iteration beside the model state: FP8 weight copies


@dataclass(frozen=True)
class StageCostTerms:
    """Coefficients of a shape; stage quantities are affine in its layer count."""

    shape: ParallelShape
    num_microbatches: int
    layer: PartCosts
    embedding: PartCosts
    head: PartCosts
    p2p_ms: float  # per microbatch per stage: v sends forward, v backward
    state_bytes_per_param: float  # the layers' (with experts: the mix of expert and replicated weights)
    end_state_bytes_per_param: float  # the embedding's and head's: replicated weights, sharded over dp x cp
    sync_bytes_per_param: float  # the sync under the last backward (`sync_bytes_per_param`)
    gather_bytes_per_param: float  # ZeRO-1's weight all-gather after the step (`gather_bytes_per_param`)
    gathered_bytes_per_param: float  # ZeRO-3's working set per parameter of a stage's largest part
    hardware: Hardware  # its NVLink topology prices each data-parallel group's in-node links (`dp_intra_gb_s`)
    nvlink_fraction: float
    dp_bandwidth_inter_gb_s: float
    groups_per_node: int  # TP groups of this size per node
    optimizer_ms_per_param: float
    bucket_params: float
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    # Hybrid sharding: shard groups holding the same shards, whose gradient shards are all-reduced
    # (`cost_models.sharded_dp`); 1 when one group spans every replica.
    replicate_ranks: int = 1
    # With expert parallelism: the experts' share of the parameters a stage syncs, which go over the expert
    # data-parallel ranks alone (`cost_models.expert_parallel.expert_sync_group`); 0 when every weight
    # syncs over the same ranks.
    expert_param_share: float = 0.0

    def in_flight(self, stage: int) -> float:
        """Microbatches whose activations `stage` holds at its peak, in layer-set units."""
        shape = self.shape
        return in_flight_microbatches(shape.schedule, stage, shape.pp, self.num_microbatches, shape.virtual_stages)

    def in_flight_row(self) -> list[float]:
        """`in_flight` of every stage."""
        shape = self.shape
        return in_flight_row(shape.schedule, shape.pp, self.num_microbatches, shape.virtual_stages)

    def dp_intra_gb_s(self, per_node: int) -> float:
        """NVLink GB/s per GPU of a data-parallel collective with `per_node` of its ranks in each node: all of it
        through NVSwitch, on a direct mesh the links to those peers (`layout.nvlink_group_gb_s`)."""
        return nvlink_group_gb_s(self.hardware, per_node) * self.nvlink_fraction

    def dp_sync_ms(self, params: float, ranks: int | None = None) -> float:
        """The data-parallel sync of `params` gradients per GPU that overlaps the backward: their all-reduce,
        or with ZeRO-1 their reduce-scatter (`sync_bytes_per_param`), over `ranks` replicas (default: the
        shape's dp), peers sharing a node while they fit. Hybrid sharding (`ranks` None): the reduce-scatter
        over the shard group, then the all-reduce of each shard across the groups holding it; with experts,
        their share over the expert ranks of the shard group, each 1 / those ranks shard across the groups."""
        if ranks is None and self.replicate_ranks > 1:
            # sync_bytes_per_param prices a reduce-scatter as half an all-reduce: twice it is the buffer
            gradient_bytes = params * 2 * self.sync_bytes_per_param
            # Shard groups are consecutive replicas: the groups holding the same shard lie in other nodes
            # while a group fits one (`cost_models.sharded_dp.node_shard_replicas`).
            across_per_node = min(self.replicate_ranks,
                                  max(1, self.groups_per_node // (self.shape.shard_replicas * self.shape.cp)))
            return self._shard_group_gather_ms(gradient_bytes) + 1e3 * sum(
                hierarchical_all_reduce_s(gradient_bytes * share / group_ranks, self.replicate_ranks, across_per_node,
                                          self.dp_intra_gb_s(across_per_node), self.dp_bandwidth_inter_gb_s)
                for share, group_ranks, _ in self._shard_groups() if share)
        return self._all_reduce_equivalent_ms(params * self.sync_bytes_per_param, ranks)

    def param_gather_ms(self, params: float, ranks: int | None = None) -> float:
        """ZeRO-1's all-gather of `params` updated weights per GPU (`gather_bytes_per_param`); 0 without ZeRO-1.
        Hybrid sharding (`ranks` None): over the shard group alone, which every group updates the same."""
        if ranks is None and self.replicate_ranks > 1:
            return self._shard_group_gather_ms(params * 2 * self.gather_bytes_per_param)
        return self._all_reduce_equivalent_ms(params * self.gather_bytes_per_param, ranks)

    def _shard_groups(self) -> tuple[tuple[float, int, int], ...]:
        """(share of the weights, ranks, ranks per node) of each group a hybrid shard group shards over: all its
        TP groups, and with experts, their share over the expert data-parallel ranks inside it."""
        ranks = self.shape.shard_replicas * self.shape.cp
        share = self.expert_param_share
        dense = (1.0 - share, ranks, min(ranks, self.groups_per_node))
        if not share:
            return (dense,)
        return dense, (share, *expert_sync_group(ranks, self.shape.expert_span, self.groups_per_node))

    def _shard_group_gather_ms(self, bytes_total: float) -> float:
        return 1e3 * sum(
            hierarchical_all_gather_s(bytes_total * share, ranks, per_node, self.dp_intra_gb_s(per_node),
                                      self.dp_bandwidth_inter_gb_s)
            for share, ranks, per_node in self._shard_groups() if share)

    def _all_reduce_equivalent_ms(self, bytes_total: float, ranks: int | None) -> float:
        """Over `ranks` TP groups (default dp x cp); with experts, their share over the expert data-parallel
        ranks among them, after the rest."""
        ranks = self.shape.grad_sync_ranks if ranks is None else ranks
        inter_gb_s, share, per_node = self.dp_bandwidth_inter_gb_s, self.expert_param_share, min(ranks, self.groups_per_node)
        dense_s = hierarchical_all_reduce_s(bytes_total * (1 - share), ranks, per_node, self.dp_intra_gb_s(per_node),
                                            inter_gb_s)
        if not share:  # the search prices this tens of thousands of times: no groups to build for dense models
            return 1e3 * dense_s
        expert_ranks, expert_per_node = expert_sync_group(ranks, self.shape.expert_span, self.groups_per_node)
        return 1e3 * (dense_s + hierarchical_all_reduce_s(bytes_total * share, expert_ranks, expert_per_node,
                                                          self.dp_intra_gb_s(expert_per_node), inter_gb_s))


@dataclass(frozen=True)
class PartSet:
    """Layer, embedding and head costs: they depend on tp, micro-batch size and recompute only."""

    layer: PartCosts
    embedding: PartCosts
    head: PartCosts


def part_costs(
    workload: Workload,
    hardware: Hardware,
    shape: ParallelShape,
    efficiency: EfficiencyParams,
    software: SoftwareConfig,
) -> PartSet:
    model = workload.model
    seq, mbs, tp, cp = workload.seq_length, shape.micro_batch_size, shape.tp, shape.cp
    local_seq = seq / cp  # what every token-linear term of one GPU sees (`cost_models.context_parallel`)
    gpu = hardware.gpu
    # What each group's collectives get of a GPU's NVLink (all of it through NVSwitch; `nvlink_group_gb_s`):
    # the TP group's, and the CP ring's sends to one neighbour.
    intra = nvlink_group_gb_s(hardware, tp)
    ring = ring_link(tp, cp, hardware.gpus_per_node, nvlink_group_gb_s(hardware, 2) * efficiency.nvlink_fraction,
                     hardware.inter_node_bandwidth_gb_s * efficiency.network_fraction)
    time = layer_time(model, seq, mbs, tp, shape.recompute, gpu, intra, efficiency, software, cp, ring,
                      expert_tp=shape.expert_tp, expert_intra_gb_s=nvlink_group_gb_s(hardware, shape.expert_tp))
    if shape.ep > 1:
        # An EP group's GPUs are expert-TP ranks apart over consecutive ranks of the stage, which fill nodes
        # (`cost_models.expert_parallel`).
        ep_ranks_per_node = max(1, hardware.gpus_per_node // shape.expert_tp)
        # The GPUs of a node a GPU's tokens go to: its EP group's there, and with the flex dispatcher every
        # expert-TP shard of theirs (on a direct NVLink mesh, the peer links it drives).
        in_node_gpus = min(shape.ep, ep_ranks_per_node) * (shape.expert_tp if software.moe_dispatcher == FLEX else 1)
        all_to_all_ms = layer_all_to_all_ms(
            model, local_seq * mbs, tp, shape.ep, ep_ranks_per_node,
            nvlink_group_gb_s(hardware, in_node_gpus) * efficiency.nvlink_fraction,
            hardware.inter_node_bandwidth_gb_s * efficiency.network_fraction, software.moe_dispatcher,
            shape.expert_tp)
        recomputed = all_to_all_ms if shape.recompute == Recompute.FULL else 0.0  # full recompute redoes the forward's
        forward_ms, backward_ms = all_to_all_ms, all_to_all_ms + recomputed
        if software.moe_a2a_overlap and a2a_overlap_applies(shape.ep, shape.pp, shape.virtual_stages, shape.recompute):
            share = merged_share(shape.pp, shape.virtual_stages, shape.num_microbatches(workload.global_batch_size))
            # The MLP node: the routed experts, and the expert-TP collectives around them (`mlp_tp_comm_ms`).
            experts_ms = routed_experts_forward_ms(model, local_seq * mbs, tp, gpu, efficiency, software,
                                                   shape.expert_tp)
            _, expert_tp_ms = mlp_tp_comm_ms(model, local_seq * mbs, tp, intra, efficiency, shape.expert_tp,
                                             software.moe_dispatcher, nvlink_group_gb_s(hardware, shape.expert_tp))
            forward_ms, backward_ms = overlapped_all_to_all_ms(
                forward_ms, backward_ms, time.forward_compute_ms + time.forward_tp_comm_ms,
                time.backward_compute_ms + time.backward_tp_comm_ms, experts_ms + expert_tp_ms,
                BACKWARD_TO_FORWARD * experts_ms + expert_tp_ms, share)
        time = replace(time, forward_ep_comm_ms=forward_ms, backward_ep_comm_ms=backward_ms)
    params = layer_params_per_gpu(model, tp, shape.ep, shape.expert_tp)
    layer = PartCosts(
        time=time,
        params=params,
        activation_bytes=layer_activation_bytes(model, seq, mbs, tp, shape.recompute, software, cp),
        cache_bytes=FP8_WEIGHT_CACHE_BYTES_PER_PARAM * params if software.fp8 else 0.0,
    )
    embedding = PartCosts(
        time=embedding_time(model, local_seq, mbs, tp, gpu, intra, efficiency),
        params=model.embedding_params / tp,
        activation_bytes=embedding_activation_bytes(model, local_seq, mbs, tp, software.sequence_parallel),
    )
    head = PartCosts(
        time=head_time(model, local_seq, mbs, tp, gpu, efficiency),
        params=model.head_params / tp + model.hidden_size,
        activation_bytes=head_activation_bytes(model, local_seq, mbs, tp),
    )
    if model.mtp_layers:
        head = _with_mtp(head, layer, model, local_seq * mbs, tp, gpu, efficiency)
    return PartSet(layer, embedding, head)


def _with_mtp(head: PartCosts, layer: PartCosts, model: ModelSpec, tokens: float, tp: int, gpu: GpuSpec,
              efficiency: EfficiencyParams) -> PartCosts:
    """The last stage's head with the multi-token-prediction depths it also runs (`ModelSpec.mtp_layers`): per
    depth a layer, the projection of 2h to h (split over TP) and the output head again, their weights and a
    layer's activations and logits beside the head's."""
    h, depths = model.hidden_size, model.mtp_layers
    projection_ms = 1e3 * gemm_time_s(2 * tokens * 2 * h * h / tp, h, gpu, efficiency)
    per_depth = _time_sum(layer.time, head.time, LayerTime(projection_ms, BACKWARD_TO_FORWARD * projection_ms, 0.0, 0.0,
                                                          weight_grad_ms=projection_ms))
    return PartCosts(
        time=_time_sum(head.time, *([per_depth] * depths)),
        params=head.params + depths * (layer.params + 2 * h * h / tp + 3 * model.norm_params),
        activation_bytes=head.activation_bytes + depths * (layer.activation_bytes + head.activation_bytes),
        cache_bytes=head.cache_bytes + depths * layer.cache_bytes,
    )


def _time_sum(*times: LayerTime) -> LayerTime:
    return LayerTime(**{f.name: sum(getattr(t, f.name) for t in times) for f in fields(LayerTime)})


# Bytes per element of the parameters the distributed optimizer all-gathers after its step: the
# bf16/fp16 model weights (its fp32 master copy stays sharded).
PARAM_GATHER_BYTES = 2


def sync_bytes_per_param(zero_stage: int, grad_reduce_bytes: int) -> float:
    """Bytes per parameter of a ring all-reduce costing the gradient sync that overlaps the backward.

    ZeRO-0 all-reduces the gradients. With ZeRO-1 (Megatron's distributed optimizer,
    megatron/core/distributed/param_and_grad_buffer.py and docs/source/api-guide/dist_optimizer.md)
    each rank reduce-scatters the gradients in `grad_reduce_bytes`: half of a ring all-reduce's
    traffic ((n-1)/n of the buffer). The all-gather of the updated weights comes after the
    optimizer step (`gather_bytes_per_param`). ZeRO-2 and 3 reduce-scatter inside every microbatch's
    backward, layer by layer (`cost_models.sharded_dp.with_sharded_comm`); the last microbatch's is this
    same reduce-scatter, priced here as ZeRO-1's against a backward that already waits for the
    collectives it cannot hide: at least its last bucket is exposed.
    """
    if zero_stage >= 1:
        return grad_reduce_bytes / 2
    return float(grad_reduce_bytes)


def gather_bytes_per_param(zero_stage: int) -> float:
    """Bytes per parameter of a ring all-reduce costing ZeRO-1's all-gather of the updated bf16 weights
    (half an all-reduce of `PARAM_GATHER_BYTES`); 0 without ZeRO-1, whose all-reduce leaves every replica
    the whole gradient. Megatron runs it after the step, or with --overlap-param-gather under the next
    iteration's forward, bucket by bucket (megatron/core/distributed/distributed_data_parallel.py
    `start_param_sync` from the forward pre-hook; `cost_models.iteration.exposed_param_gather_ms`).
    ZeRO-2 gathers the same way. ZeRO-3 gathers each layer as it computes it, every microbatch
    (`cost_models.sharded_dp`); the first microbatch's gathers are this same traffic, priced here against a
    forward that already waits for what it cannot hide: at least the first bucket is exposed."""
    return PARAM_GATHER_BYTES / 2 if zero_stage >= 1 else 0.0


def stage_cost_terms(
    workload: Workload,
    hardware: Hardware,
    shape: ParallelShape,
    efficiency: EfficiencyParams,
    software: SoftwareConfig,
    parts: PartSet | None = None,
) -> StageCostTerms:
    """Cost coefficients of `shape`; pass `parts` (from `part_costs`) to reuse layer costs across shapes."""
    model = workload.model
    gpu = hardware.gpu
    microbatches = shape.num_microbatches(workload.global_batch_size)
    parts = parts or part_costs(workload, hardware, shape, efficiency, software)
    layer, embedding, head = parts.layer, parts.embedding, parts.head
    if model.tied_embeddings and shape.pp == 1:
        # With pp == 1 a tied head shares the embedding's weights; otherwise
        # the last stage holds its own copy (Megatron keeps the two in sync).
        head = replace(head, params=head.params - model.head_params / shape.tp)

    # Megatron's rank order is tp, dp, pp (fastest first): data-parallel
    # peers share a node while they fit.
    groups_per_node = max(1, hardware.gpus_per_node // shape.tp)
    dp_inter_gb_s = hardware.inter_node_bandwidth_gb_s * efficiency.network_fraction
    # Optimizer state (and ZeRO-2/3's shards) over the ranks holding the same weights: with expert
    # parallelism the experts' fewer (`cost_models.expert_parallel`). Hybrid sharding shards over its
    # group's replicas alone, the experts over the expert ranks inside it (every EP group lies inside one
    # shard group: `ParallelShape.shard_group_holds_ep_groups`).
    dense_ranks = shape.shard_replicas * shape.cp if shape.hybrid_sharded else shape.grad_sync_ranks
    state_ranks = expert_data_parallel(dense_ranks, shape.expert_span)
    optimizer_bytes = optimizer_bytes_per_param(software.master_weights)
    dense_state_bytes = state_bytes_per_param(workload.zero_stage, dense_ranks, software.grad_bytes, optimizer_bytes)
    expert_state_bytes = state_bytes_per_param(workload.zero_stage, state_ranks, software.grad_bytes, optimizer_bytes)
    if expert_state_bytes == dense_state_bytes or not layer.params:  # every kind over the same ranks
        layer_state_bytes_per_param = dense_state_bytes
    else:
        layer_state_bytes_per_param = layer_state_bytes_per_gpu(
            model, shape.tp, shape.ep, shape.expert_tp, dense_state_bytes, expert_state_bytes) / layer.params
    # The experts' share of a layer syncs over the expert data-parallel ranks, the rest over dp x cp.
    expert_share = expert_param_share(model, shape.tp, shape.ep, shape.expert_tp) if shape.expert_span > 1 else 0.0
    if shards_every_microbatch(workload.zero_stage):
        dense_group = (1.0 - expert_share, dense_ranks, min(dense_ranks, groups_per_node))
        expert_group = (expert_share, *expert_sync_group(dense_ranks, shape.expert_span, groups_per_node))
        links = (lambda per_node: nvlink_group_gb_s(hardware, per_node) * efficiency.nvlink_fraction, dp_inter_gb_s)
        overlap = efficiency.shard_overlap_fraction
        layer = _sharded_part(layer, workload.zero_stage, software.grad_reduce_bytes, (dense_group, expert_group),
                              overlap, *links)
        embedding, head = (_sharded_part(part, workload.zero_stage, software.grad_reduce_bytes,
                                         ((1.0, *dense_group[1:]),), overlap, *links) for part in (embedding, head))
    p2p_ms = pipeline_p2p_ms(workload, hardware, shape, efficiency, software)

    # The step updates the optimizer state each GPU holds: at the layers' mix of expert and replicated weights.
    expert_fraction = (0.0 if expert_state_bytes == dense_state_bytes else min(1.0, max(0.0, (
        layer_state_bytes_per_param - dense_state_bytes) / (expert_state_bytes - dense_state_bytes))))
    optimizer_params_share = ((1 - expert_fraction) / dense_ranks + expert_fraction / state_ranks
                              if workload.zero_stage >= 1 else 1.0)
    optimizer_ms_per_param = (
        1e3 * (ADAM_STEP_BYTES_PER_PARAM if software.master_weights else BF16_ADAM_STEP_BYTES_PER_PARAM)
        * optimizer_params_share / (gpu.hbm_bandwidth_gb_s * 1e9 * efficiency.hbm_fraction)
    )
    return StageCostTerms(
        shape=shape,
        num_microbatches=microbatches,
        layer=layer,
        embedding=embedding,
        head=head,
        p2p_ms=p2p_ms,
        state_bytes_per_param=layer_state_bytes_per_param,
        end_state_bytes_per_param=dense_state_bytes,
        sync_bytes_per_param=sync_bytes_per_param(workload.zero_stage, software.grad_reduce_bytes),
        gather_bytes_per_param=gather_bytes_per_param(workload.zero_stage),
        gathered_bytes_per_param=gathered_bytes_per_param(workload.zero_stage),
        hardware=hardware,
        nvlink_fraction=efficiency.nvlink_fraction,
        dp_bandwidth_inter_gb_s=dp_inter_gb_s,
        groups_per_node=groups_per_node,
        optimizer_ms_per_param=optimizer_ms_per_param,
        bucket_params=float(software.ddp_bucket_params),
        overlap_grad_reduce=software.overlap_grad_reduce,
        overlap_param_gather=software.overlap_param_gather,
        replicate_ranks=shape.dp // shape.shard_replicas,
        expert_param_share=expert_share,
    )


def _sharded_part(part: PartCosts, zero_stage: int, grad_reduce_bytes: int,
                  groups: tuple[tuple[float, int, int], ...], overlap_fraction: float,
                  intra_gb_s: Callable[[int], float], inter_gb_s: float) -> PartCosts:
    """`part` with ZeRO-2/3's per-microbatch collectives of its weights, the part compute does not hide
    (`cost_models.sharded_dp.with_sharded_comm`): each (share of the weights, ranks, ranks per node) of
    `groups` over its own ranks, one after the other, in a node at `intra_gb_s(ranks per node)`."""
    def collective_ms(bytes_per_param: float) -> float:
        return 1e3 * sum(
            hierarchical_all_gather_s(part.params * share * bytes_per_param, ranks, per_node, intra_gb_s(per_node),
                                      inter_gb_s)
            for share, ranks, per_node in groups if share)

    time = with_sharded_comm(part.time, zero_stage, collective_ms(PARAM_GATHER_BYTES), collective_ms(grad_reduce_bytes),
                             overlap_fraction)
    return replace(part, time=time)


def pipeline_p2p_ms(
    workload: Workload,
    hardware: Hardware,
    shape: ParallelShape,
    efficiency: EfficiencyParams,
    software: SoftwareConfig,
    in_node: bool | None = None,
) -> float:
    """`StageCostTerms.p2p_ms` of `shape` (the planner prices links for another replica count).
    `in_node`: whether the sends stay in a node, when the caller knows the job's devices; None: the
    shape's own device count decides."""
    if shape.pp <= 1:
        return 0.0
    # Megatron's rank order is tp, dp, pp (fastest first): pipeline neighbours cross nodes
    # unless the whole job fits in one.
    mbs, tp = shape.micro_batch_size, shape.tp
    # Each CP rank sends its own share of the sequence.
    local_tokens = workload.seq_length * mbs / shape.cp
    p2p_bytes = 2.0 * local_tokens * workload.model.hidden_size / (tp if software.scatter_gather_p2p else 1)
    if in_node is None:
        in_node = shape.devices <= hardware.gpus_per_node
    if in_node:
        bandwidth, latency = nvlink_group_gb_s(hardware, 2) * efficiency.nvlink_fraction, NVLINK_STEP_LATENCY_S
    else:
        bandwidth, latency = hardware.inter_node_bandwidth_gb_s * efficiency.network_fraction, NETWORK_STEP_LATENCY_S
    # Every model chunk sends its output on and its input gradient back,
    # so interleaving multiplies the transfers by v.
    transfers = 2.0 * shape.virtual_stages
    return transfers * 1e3 * point_to_point_s(p2p_bytes, bandwidth, latency)


@dataclass(frozen=True)
class StageMemory:
    """One GPU of a stage: memory that stays, and what each in-flight microbatch adds."""

    static_bytes: float  # weights, gradients, optimizer state, the head's logits
    per_microbatch_bytes: float  # activations of one microbatch through the stage's layers

    def peak_bytes(self, in_flight: float) -> float:
        return self.static_bytes + in_flight * self.per_microbatch_bytes


def stage_memory(terms: StageCostTerms, stage: int, layers: int) -> StageMemory:
    last = terms.shape.pp - 1
    end_params = 0.0
    per_microbatch = layers * terms.layer.activation_bytes
    # The head's logits live only between its forward and backward, which run back to back.
    once = 0.0
    if stage == 0:
        end_params += terms.embedding.params
        per_microbatch += terms.embedding.activation_bytes
    if stage == last:
        end_params += terms.head.params
        once += terms.head.activation_bytes
    fragmentation = 1 + ACTIVATION_FRAGMENTATION
    state_bytes = layers * terms.layer.params * terms.state_bytes_per_param + end_params * terms.end_state_bytes_per_param
    return StageMemory(
        static_bytes=state_bytes + layers * terms.layer.cache_bytes + once * fragmentation
        + gathered_bytes(terms, stage),
        per_microbatch_bytes=per_microbatch * fragmentation,
    )


def gathered_bytes(terms: StageCostTerms, stage: int) -> float:
    """ZeRO-3's gathered working set on one GPU of `stage`: its largest part whole, twice (computed and
    prefetched), counted whether or not the stage holds layers so that it is affine in their count."""
    if not terms.gathered_bytes_per_param:
        return 0.0
    largest = terms.layer.params
    if stage == 0:
        largest = max(largest, terms.embedding.params)
    if stage == terms.shape.pp - 1:
        largest = max(largest, terms.head.params)
    return terms.gathered_bytes_per_param * largest


def stage_memory_bytes(terms: StageCostTerms, stage: int, layers: int) -> float:
    """Peak memory of one GPU of `stage` holding `layers` layers under the shape's schedule."""
    return stage_memory(terms, stage, layers).peak_bytes(terms.in_flight(stage))


def max_layers_fitting(terms: StageCostTerms, stage: int, memory_bytes: float) -> int:
    """Most layers `stage` can hold within `memory_bytes` (may be < 1: nothing fits)."""
    return _max_layers(terms, stage_memory(terms, stage, 0), memory_bytes, terms.in_flight(stage))


def max_layers_fitting_all(terms: StageCostTerms, memory_bytes: float) -> tuple[int, ...]:
    """`max_layers_fitting` of every stage of the shape (the planner asks for whole rows)."""
    last = terms.shape.pp - 1
    # A stage's memory without layers depends only on whether it is the first, the last or a
    # middle one: each is built once per row (the row is the planner's hot path).
    empty = {0: stage_memory(terms, 0, 0), last: stage_memory(terms, last, 0)}
    middle = stage_memory(terms, 1, 0) if last > 1 else None
    return tuple(
        _max_layers(terms, empty.get(stage, middle), memory_bytes, in_flight)
        for stage, in_flight in enumerate(terms.in_flight_row())
    )


def layer_caps_outline(terms: StageCostTerms, memory_bytes: float) -> tuple[int, int, int | None]:
    """The first and last stages' `max_layers_fitting` and the most any middle stage holds (None without
    middle stages): enough to rule a shape out without its whole row (middle stages share their memory
    without layers and differ only in microbatches in flight, the fewest of which gives the most layers)."""
    shape = terms.shape
    last = shape.pp - 1
    # Microbatches in flight never rise from one stage to the next (`in_flight_row`), so the middle stage
    # with the fewest is the one before the last.
    first, before_last, at_last = in_flight_row(shape.schedule, shape.pp, terms.num_microbatches,
                                                shape.virtual_stages, (0, max(0, last - 1), last))
    first_cap = _max_layers(terms, stage_memory(terms, 0, 0), memory_bytes, first)
    last_cap = _max_layers(terms, stage_memory(terms, last, 0), memory_bytes, at_last)
    middle_cap = _max_layers(terms, stage_memory(terms, 1, 0), memory_bytes, before_last) if last > 1 else None
    return first_cap, last_cap, middle_cap


def _max_layers(terms: StageCostTerms, empty: StageMemory, memory_bytes: float, in_flight: float) -> int:
    """Most layers within `memory_bytes`, `empty` being the stage's memory without layers."""
    fixed = empty.peak_bytes(in_flight)
    per_layer = (
        terms.layer.params * terms.state_bytes_per_param + terms.layer.cache_bytes
        + terms.layer.activation_bytes * in_flight * (1 + ACTIVATION_FRAGMENTATION)
    )
    return int((memory_bytes - fixed) // per_layer)


