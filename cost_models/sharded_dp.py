"""Sharded data parallelism beyond ZeRO-1: ZeRO-2 (gradients sharded too) and ZeRO-3 / FSDP (weights too).

What each stage shards over the data-parallel group of d replicas, per parameter (bytes on one GPU;
`cost_models.memory.state_bytes_per_param`):

    stage   bf16 weights   fp32 gradients   fp32 master + Adam m, v   sync
    0       2              4                12                        all-reduce under the last backward
    1       2              4                12 / d                    reduce-scatter under the last backward,
                                                                      weight all-gather after the step
    2       2              4 / d            12 / d                    reduce-scatter under *every* microbatch's
                                                                      backward, weight all-gather after the step
    3       2 / d          4 / d            12 / d                    per layer, every microbatch: all-gather in
                                                                      forward, again in backward, reduce-scatter

Sources: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(SC'20), Figure 1 and section 7 (Pos, Pos+g, Pos+g+p; 3x the traffic of stage 1 at stage 3); DeepSpeed's
own estimators, `deepspeed/runtime/zero/stage_1_and_2.py estimate_zero2_model_states_mem_needs`
(2 P + 18 P / d without offload) and `stage3.py estimate_zero3_model_states_mem_needs` (4 x the largest
layer + 18 P / d; tests/cost_models/test_sharded_dp.py checks ours against both); Zhao et al., "PyTorch
FSDP" (VLDB'23) section 3 (FULL_SHARD: all-gather before forward and again before backward, reduce-scatter
after backward, one unit prefetched). DeepSpeed's stage 2 reduces every micro-step's gradients into
the rank's partition (there is nowhere else to accumulate them), so with m microbatches per step it
reduce-scatters m times; so does FSDP, which has no unsharded gradient either.

Timing: the per-layer collectives run on their own stream, a layer ahead (DeepSpeed's prefetch,
FSDP's `forward_prefetch`/`backward_prefetch`, Megatron-FSDP's bucketed all-gather), so a layer costs
max(compute, collectives): the exposed excess max(0, collectives - compute) is added to the layer's
forward and backward (`LayerTime.forward_shard_comm_ms`, `backward_shard_comm_ms`). That is the design;
a stack may hide less. FSDP2 prefetches implicitly: a layer's all-gather is issued when the host reaches
that layer, so it overlaps only as far as the host runs ahead of the GPU (torch.distributed.fsdp's
`FSDPModule.set_modules_to_forward_prefetch` exists for when it does not), and NCCL's kernels share SMs and
HBM with the GEMMs they overlap. `EfficiencyParams.shard_overlap_fraction` h says how much can hide:
exposed = (1 - h) x collectives + max(0, h x collectives - compute); 1 in the A100 fit, Hopper's fitted value
on GPUs with FP8 tensor cores (`cost_models.gpu_efficiency`), and a calibration measures a stack's. KempnerForge's published FSDP2 runs (benchmarks/calibration/modern_runs.json)
grow from one node to eight by about their whole FSDP traffic at the network's rate. It is priced at full
speed: a slow GPU's longer compute hides more of it, which this leaves out (the price is then high, never
low). The step's first gather and last reduce-scatter have nothing to hide under: they are the
ZeRO-1-style step-end terms (`cost_models.stage_costs.sync_bytes_per_param`, `gather_bytes_per_param`),
which leave at least a bucket of each exposed.

Hybrid sharding (HSDP: PyTorch FSDP's HYBRID_SHARD and FSDP2 on a 2-D (replicate, shard) mesh, torchtitan's
`data_parallel_replicate_degree` x `_shard_degree`; Megatron's `--num-distributed-optimizer-instances`,
with Megatron-FSDP `--outer-dp-sharding-strategy no_shard`; DeepSpeed's MiCS `mics_shard_size`, Zhang et
al., "MiCS", VLDB'23): the state is sharded over a group of s = `ParallelShape.shard_replicas` replicas
(consecutive, so inside a node while they fit) and the dp / s groups hold the same shards. Per GPU the
table's 1/d becomes 1/s; the per-microbatch collectives run over the s ranks of the group; the gradient
sync is the group's reduce-scatter, then an all-reduce of each 1/s shard across the groups, once a step
(gradients accumulate in the shard until the last microbatch: FSDP2's `set_requires_all_reduce(False)`
before it, PyTorch's documented HSDP accumulation; MiCS's all-reduce at the accumulation boundary); the
updated weights are all-gathered inside the group alone (`StageCostTerms.dp_sync_ms`, `param_gather_ms`). With
expert parallelism each EP group lies inside a shard group (`ParallelShape.shard_group_holds_ep_groups`): a routed
expert's state is sharded over the group's ranks holding it (s x cp / (ep x etp / tp) of them) and replicated across
the groups, as torchtitan's (dp_replicate, efsdp, ep) mesh and megatron-core's partial expert data-parallel groups
lay it out; its sync is the same reduce-scatter, then all-reduce, over those ranks.
Across nodes it moves the 1/s shard twice (all-reduce) where full sharding moves the 1/n shard of
gradients and of weights once each: with s the replicas of a node, no fewer bytes cross the network.
What it buys is ZeRO-2/3's per-layer traffic on NVLink, paid for with s/n more state per GPU.

Memory of ZeRO-3's working set: the layer being computed and the one prefetched are whole, 2 x 2 bytes
per parameter of the largest part a stage holds (DeepSpeed's `largest_layer_memory = 4 *
largest_layer_params`).
"""

from __future__ import annotations

from dataclasses import replace
from math import gcd

from cost_models.compute import LayerTime
from cost_models.memory import WEIGHT_BYTES_PER_PARAM

# ZeRO-3: the part being computed and the next one, prefetched, are gathered whole (bf16).
GATHERED_PARTS = 2


def gathered_bytes_per_param(zero_stage: int) -> float:
    """Bytes per parameter of the largest part of a stage that ZeRO-3 holds gathered (0 below stage 3)."""
    return GATHERED_PARTS * WEIGHT_BYTES_PER_PARAM if zero_stage >= 3 else 0.0


def node_shard_replicas(dp: int, group_gpus: int, gpus_per_node: int) -> int | None:
    """Replicas of a hybrid shard group that fills a node with stages of `group_gpus` GPUs: the most that
    divide both dp and the node's stages (so groups never straddle nodes). None where that is not a hybrid
    layout: one replica (nothing sharded) or all of them (full sharding)."""
    if group_gpus > gpus_per_node:
        return None
    replicas = gcd(dp, gpus_per_node // group_gpus)
    return replicas if 1 < replicas < dp else None


def shards_every_microbatch(zero_stage: int) -> bool:
    """Whether the gradient sync happens inside every microbatch's backward (stages 2 and 3) rather
    than once, under the last one."""
    return zero_stage >= 2


def with_sharded_comm(time: LayerTime, zero_stage: int, gather_ms: float, reduce_scatter_ms: float,
                      overlap_fraction: float = 1.0) -> LayerTime:
    """`time` with the exposed part of ZeRO-2/3's per-microbatch collectives of one part (a layer, the
    embedding or the head): `gather_ms` is its weights' all-gather, `reduce_scatter_ms` its gradients'
    reduce-scatter, both over the data-parallel group. Of each pass's collectives, `overlap_fraction`
    (`EfficiencyParams.shard_overlap_fraction`) can hide under the pass's compute and the rest is exposed.
    Unchanged below stage 2."""
    if not shards_every_microbatch(zero_stage):
        return time
    forward_comm = gather_ms if zero_stage >= 3 else 0.0
    backward_comm = reduce_scatter_ms + (gather_ms if zero_stage >= 3 else 0.0)

    def exposed_ms(comm_ms: float, compute_ms: float) -> float:
        hideable_ms = overlap_fraction * comm_ms
        return comm_ms - hideable_ms + max(0.0, hideable_ms - compute_ms)

    return replace(
        time,
        forward_shard_comm_ms=exposed_ms(forward_comm, time.forward_ms),
        backward_shard_comm_ms=exposed_ms(backward_comm, time.backward_ms),
    )
