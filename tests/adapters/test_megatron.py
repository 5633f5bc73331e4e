"""The Megatron-LM export, checked by megatron-core 0.16's own code on CPU.

Each real plan's emitted arguments are parsed back (with the definitions of
those flags copied from Megatron-LM's megatron/training/arguments.py, which
is not part of the megatron-core wheel) and handed to megatron-core:

- `parallel_state.initialize_model_parallel` under torch's fake process
  group, for a rank of every pipeline stage: TP/PP/DP/VPP sizes, and the
  devices of the rank's TP, PP and DP groups, where a rank's device is the
  one torchrun + CUDA_VISIBLE_DEVICES of `launch_command` give it;
- `TransformerConfig.__post_init__`, built as Megatron-LM's
  `core_transformer_config_from_args` builds it;
- the layers megatron-core builds on each pipeline rank and model chunk
  (`get_transformer_layer_offset` / `get_num_layers_to_build`, or the
  `PipelineParallelLayerLayout`), against the plan's stages;
- its microbatch calculator, and its (interleaved) 1F1B order
  (`get_schedule_table`, `get_pp_rank_microbatches`) against the plan's
  pipeline_schedule timelines.

Deliberately broken plans must be rejected by that same megatron-core code.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import warnings
from functools import cache

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore

with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": expected on CPU
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.src.megatron_fsdp.fully_shard import ShardingStrategy
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        get_num_microbatches,
        init_num_microbatches_calculator,
    )
    from megatron.core.pipeline_parallel.schedules import (
        get_pp_rank_microbatches,
        get_schedule_table,
    )
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from adapters import megatron
from adapters.registry import ExportError, export_format
from api.tasks.planning import estimate_for, plan_for
from planner.schedules.handcrafted import interleaved_1f1b
from planner.schedules.ops import Op, parse_op
from tests.api.support import EXAMPLES_DIR, estimate_request, small_request
from wire.schemas import EstimateRequest, Plan, PlanRequest

STOCK = {"time_limit_s": 2, "allow_non_uniform": False}
# Mixtral-8x7B's shape with a shared expert added (the flag has to be exercised)
SMALL_MOE = {"name": "mixtral-like", "num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 14336,
             "num_attention_heads": 32, "num_kv_heads": 8, "vocab_size": 32000, "num_experts": 8,
             "experts_per_token": 2, "shared_expert_ffn_hidden_size": 2048, "rope_theta": 1e6}

# megatron-core warns that Transformer Engine and Apex are missing, and about options of their kernels
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:megatron")

# ---------------------------------------------------------------------------------------------------------------
# Real plans (planned once per test session)


def _example(name: str) -> Plan:
    body = json.loads((EXAMPLES_DIR / f"{name}.json").read_text())
    body["options"] = {**body.get("options", {}), **STOCK}
    return plan_for(PlanRequest.model_validate(body))


def _estimate(layout: dict) -> Plan:
    return estimate_for(EstimateRequest.model_validate(estimate_request(layout)))


def _replica_major(plan: Plan) -> Plan:
    """The same plan with each replica kept on one node (stages side by side): needs --use-tp-pp-dp-mapping."""
    first = plan.replicas[0].stages[0]
    tp, pp = first.tp * first.cp, len(plan.replicas[0].stages)  # a stage's GPUs
    per_node = 8 // (tp * pp)
    replicas = []
    for replica in plan.replicas:
        node, slot = divmod(replica.id, per_node)
        stages = [
            stage.model_copy(update={"devices": [f"{node}:{(slot * pp + s) * tp + t}" for t in range(tp)]})
            for s, stage in enumerate(replica.stages)
        ]
        replicas.append(replica.model_copy(update={"stages": stages}))
    return plan.model_copy(update={"replicas": replicas})


PLANS = {
    # llama2-70b on 256 A100s: interleaved (v=4), GQA, tp 4 x pp 4 x dp 16
    "healthy-interleaved-70b": lambda: _example("healthy-256xa100-llama2-70b"),
    # qwen2.5-32b with failed and slow GPUs: pp 7, first stage 6 layers, last 8, middle 10; GQA
    "uneven-first-last": lambda: _example("mixed-256xa100-qwen2.5-32b"),
    # llama3-8b with a slow GPU: only the last stage differs (2 layers); tp 1
    "uneven-last-only": lambda: _example("slow-64xh100-llama3-8b"),
    # a failed GPU: node 1 runs 6 ranks, node 0 runs 8; uneven first/last
    "failed-gpu": lambda: plan_for(PlanRequest.model_validate(small_request(options=STOCK, failures={"failed": ["1:3"]}))),
    # llama3-8b (GQA, 8 KV heads) with tp 2
    "gqa-llama3-8b": lambda: plan_for(PlanRequest.model_validate(small_request(
        model="llama3-8b", training={"global_batch_size": 64, "seq_length": 8192}, options=STOCK))),
    # fixed layouts: recompute none / selective / full
    "recompute-none": lambda: _estimate({"tp": 2, "pp": 2, "recompute": "none"}),
    "recompute-selective-interleaved": lambda: _estimate(
        {"tp": 1, "pp": 4, "virtual_stages": 2, "schedule": "interleaved", "recompute": "selective"}),
    "recompute-full-layout": lambda: _estimate({"tp": 2, "pp": 4, "layers_per_stage": [8, 7, 9, 8], "recompute": "full"}),
    # uneven model chunks (layers_per_chunk): the embedding's and the loss's chunks one layer short, as
    # Megatron-Bridge's --account-for-embedding/loss-in-pipeline-split cuts them
    "uneven-chunks": lambda: _estimate({"tp": 1, "pp": 4, "virtual_stages": 2, "schedule": "interleaved",
                                        "recompute": "selective", "layers_per_chunk": [3, 4, 4, 5, 5, 4, 4, 3]}),
    # FP8 training on H100s (Transformer Engine, hybrid E4M3/E5M2)
    "fp8-h100": lambda: plan_for(PlanRequest.model_validate(small_request(
        cluster={"num_nodes": 2, "gpus_per_node": 8, "gpu": "H100-SXM"}, model="llama3-8b",
        training={"global_batch_size": 64, "seq_length": 8192, "precision": "fp8"}, options=STOCK))),
    # ZeRO-2 and ZeRO-3 through Megatron-FSDP (llama3-8b on 16 H100s)
    "zero2-fsdp": lambda: plan_for(PlanRequest.model_validate(small_request(
        cluster={"num_nodes": 2, "gpus_per_node": 8, "gpu": "H100-SXM"}, model="llama3-8b",
        training={"global_batch_size": 64, "seq_length": 8192, "zero_stage": 2}, options=STOCK))),
    "zero3-fsdp": lambda: plan_for(PlanRequest.model_validate(small_request(
        cluster={"num_nodes": 2, "gpus_per_node": 8, "gpu": "H100-SXM"}, model="llama3-8b",
        training={"global_batch_size": 64, "seq_length": 8192, "zero_stage": 3}, options=STOCK))),
    # hybrid sharding: ZeRO-3 on 32 H100s sharded inside each node (the search's choice, HSDP through Megatron-FSDP;
    # TP 2 since Hopper's FSDP overlap was fitted, 2026-12-06),
    # and a fixed layout of Megatron's partial distributed optimizer (ZeRO-1 over 2 groups of 4 replicas, cp 2)
    "zero3-hybrid": lambda: plan_for(PlanRequest.model_validate(small_request(
        cluster={"num_nodes": 4, "gpus_per_node": 8, "gpu": "H100-SXM"}, model="llama3-8b",
        training={"global_batch_size": 64, "seq_length": 8192, "zero_stage": 3}, options=STOCK))),
    "zero1-partial-instances": lambda: _estimate({"tp": 1, "cp": 2, "pp": 2, "dp": 8, "dp_shard": 4}),
    # bf16 gradients (--grad-reduce-in-bf16): the gradient buffer and its reduction in bf16
    "bf16-grads": lambda: estimate_for(EstimateRequest.model_validate(estimate_request(
        {"tp": 2, "pp": 2}, training={"global_batch_size": 256, "seq_length": 4096, "grad_precision": "bf16"}))),
    # context parallelism: a fixed tp 2 x cp 2 layout, and a 64k-token plan the search gives CP (llama3-8b, 16 H100s)
    "context-parallel-layout": lambda: _estimate({"tp": 2, "cp": 2, "pp": 2, "recompute": "selective"}),
    "context-parallel-64k": lambda: plan_for(PlanRequest.model_validate(small_request(
        cluster={"num_nodes": 2, "gpus_per_node": 8, "gpu": "H100-SXM"}, model="llama3-8b",
        training={"global_batch_size": 8, "seq_length": 65536}, options=STOCK))),
    # a mixture of experts (8 experts, top-2, a shared expert), experts sharded over TP (16 H100s)
    "moe-experts-over-tp": lambda: plan_for(PlanRequest.model_validate(small_request(
        cluster={"num_nodes": 2, "gpus_per_node": 8, "gpu": "H100-SXM"}, model=SMALL_MOE,
        training={"global_batch_size": 32, "seq_length": 4096}, options=STOCK))),
    # the same model on 64 H100s, one GPU slow: the search splits the experts over replicas (EP > 1)
    "moe-expert-parallel": lambda: plan_for(PlanRequest.model_validate(small_request(
        cluster={"num_nodes": 8, "gpus_per_node": 8, "gpu": "H100-SXM"}, model=SMALL_MOE,
        failures={"slow": [{"device": "3:2", "speed": 0.6}]},
        training={"global_batch_size": 256, "seq_length": 4096}, options=STOCK))),
    # the same on 16 H100s as Megatron's MoE recipes lay it out: tp 2, whole experts (expert-TP 1) over 4 GPUs
    "moe-expert-tp-1": lambda: estimate_for(EstimateRequest.model_validate(estimate_request(
        {"tp": 2, "pp": 4, "ep": 4, "etp": 1}, cluster={"num_nodes": 2, "gpus_per_node": 8, "gpu": "H100-SXM"},
        model=SMALL_MOE, training={"global_batch_size": 64, "seq_length": 4096}))),
    # the same interleaved over 4 stages on 32 H100s, its all-to-alls under Megatron's batch-level EP overlap
    "moe-a2a-overlap": lambda: estimate_for(EstimateRequest.model_validate(estimate_request(
        {"tp": 2, "pp": 4, "virtual_stages": 2, "schedule": "interleaved", "ep": 8, "etp": 1, "recompute": "selective"},
        cluster={"num_nodes": 4, "gpus_per_node": 8, "gpu": "H100-SXM"}, model=SMALL_MOE,
        training={"global_batch_size": 64, "seq_length": 4096, "moe_a2a_overlap": True}))),
    # the same with Megatron's partial distributed optimizer (ZeRO-1 over 2 groups of 2 replicas): each EP group of
    # 4 whole experts lies inside a group, whose ranks holding the same experts shard their state
    "moe-ep-partial-instances": lambda: estimate_for(EstimateRequest.model_validate(estimate_request(
        {"tp": 2, "pp": 4, "dp": 4, "ep": 4, "etp": 1, "dp_shard": 2, "recompute": "full"},
        cluster={"num_nodes": 4, "gpus_per_node": 8, "gpu": "H100-SXM"}, model=SMALL_MOE,
        training={"global_batch_size": 64, "seq_length": 4096}))),
    # the same with context parallelism 2: each EP group takes a replica's two CP ranks, then the next replica's
    "moe-expert-cp": lambda: estimate_for(EstimateRequest.model_validate(estimate_request(
        {"tp": 2, "cp": 2, "pp": 4, "ep": 4, "recompute": "full"},
        cluster={"num_nodes": 4, "gpus_per_node": 8, "gpu": "H100-SXM"}, model=SMALL_MOE,
        training={"global_batch_size": 32, "seq_length": 8192}))),
    # the same, its tokens sent with DeepEP's kernels (the flex dispatcher)
    "moe-flex-dispatcher": lambda: plan_for(PlanRequest.model_validate(small_request(
        cluster={"num_nodes": 8, "gpus_per_node": 8, "gpu": "H100-SXM"}, model=SMALL_MOE,
        failures={"slow": [{"device": "3:2", "speed": 0.6}]},
        training={"global_batch_size": 256, "seq_length": 4096, "moe_dispatcher": "flex"}, options=STOCK))),
    # Qwen3-30B-A3B: 128 experts, heads 128 wide over a hidden size of 2,048, query/key norms (32 H100s)
    "qwen3-moe": lambda: plan_for(PlanRequest.model_validate(small_request(
        cluster={"num_nodes": 4, "gpus_per_node": 8, "gpu": "H100-SXM"}, model="qwen3-30b-a3b",
        training={"global_batch_size": 128, "seq_length": 4096}, options=STOCK))),
    # Transformer Engine's TP overlap (--tp-comm-overlap), llama3-8b at tp 4 on 16 H100s
    "tp-comm-overlap": lambda: estimate_for(EstimateRequest.model_validate(estimate_request(
        {"tp": 4, "pp": 2}, cluster={"num_nodes": 2, "gpus_per_node": 8, "gpu": "H100-SXM"}, model="llama3-8b",
        training={"global_batch_size": 64, "seq_length": 8192, "tp_comm_overlap": "megatron"}))),
    # llama2-13b interleaved, relabelled so each replica sits on one node
    "replica-major": lambda: _replica_major(plan_for(PlanRequest.model_validate(small_request(
        model="llama2-13b", training={"global_batch_size": 64, "seq_length": 8192},
        options={**STOCK, "schedules": ["interleaved"]})))),
}


@cache
def real_plan(name: str) -> Plan:
    return PLANS[name]()


# ---------------------------------------------------------------------------------------------------------------
# Megatron-LM's argument definitions for the flags the adapter emits (copied from megatron/training/arguments.py)


def _moe_freq_type(x: str) -> int | list[int]:
    """Megatron-LM's moe_freq_type with its _eval_pattern: a whole number, or a list expression of digits,
    brackets, commas, + and * only."""
    if "[" not in x:
        return int(x)
    if re.compile(r"[^,\d\[\]\(\)\+\*]").search(x):
        raise ValueError(f"Invalid pattern: {x}")
    return eval(x)  # noqa: S307 - what Megatron-LM does, after the same character check


def megatron_lm_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    add = parser.add_argument
    add("--tensor-model-parallel-size", type=int, default=1)
    add("--pipeline-model-parallel-size", type=int, default=1)
    add("--context-parallel-size", type=int, default=1)
    add("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    add("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    add("--microbatch-group-size-per-virtual-pipeline-stage", type=int, default=None,
        dest="microbatch_group_size_per_vp_stage")
    add("--decoder-first-pipeline-num-layers", type=int, default=None)
    add("--decoder-last-pipeline-num-layers", type=int, default=None)
    add("--pipeline-model-parallel-layout", type=str, default=None)
    add("--use-tp-pp-dp-mapping", action="store_true", default=False)
    add("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm")
    add("--sequence-parallel", action="store_true")
    add("--tp-comm-overlap", action="store_true")
    add("--num-layers", type=int, default=None)
    add("--hidden-size", type=int, default=None)
    add("--ffn-hidden-size", type=int, default=None)
    add("--num-attention-heads", type=int, default=None)
    add("--group-query-attention", action="store_true")
    add("--num-query-groups", type=int, default=1)
    add("--swiglu", action="store_true")
    add("--untie-embeddings-and-output-weights", action="store_true")
    add("--kv-channels", type=int, default=None)
    add("--qk-layernorm", action="store_true")
    add("--num-experts", type=int, default=None)
    add("--moe-router-topk", type=int, default=2)
    add("--moe-ffn-hidden-size", type=int, default=None)
    add("--moe-shared-expert-intermediate-size", type=int, default=None)
    add("--expert-model-parallel-size", type=int, default=1)
    add("--expert-tensor-parallel-size", type=int, default=None)
    add("--overlap-moe-expert-parallel-comm", action="store_true")
    add("--moe-layer-freq", type=_moe_freq_type, default=1)
    add("--moe-token-dispatcher-type", type=str, default="allgather", choices=["allgather", "alltoall", "flex"])
    add("--moe-flex-dispatcher-backend", type=str, default="deepep", choices=["deepep", "hybridep"])
    add("--mtp-num-layers", type=int, default=None)
    # _add_mla_args, and multi_latent_attention from TransformerConfig's fields
    add("--multi-latent-attention", action="store_true")
    add("--q-lora-rank", type=int, default=None)
    add("--kv-lora-rank", type=int, default=32)
    add("--qk-head-dim", type=int, default=128)
    add("--qk-pos-emb-head-dim", type=int, default=64)
    add("--v-head-dim", type=int, default=128)
    add("--rotary-scaling-factor", type=float, default=1.0)
    add("--mscale", type=float, default=1.0)
    add("--mscale-all-dim", type=float, default=0.0)
    add("--rope-type", type=str, default=None, choices=["rope", "yarn"])
    add("--softmax-type", type=str, default="vanilla", choices=["vanilla", "off-by-one", "learnable"])  # factory
    add("--window-size", type=lambda x: tuple(int(i) for i in x.strip("()").split(",")), default=None)  # tuple_type
    add("--window-attn-skip-freq", type=int, default=None)  # moe_freq_type, for a whole number
    # these four come from TransformerConfig's fields through Megatron-LM's ArgumentGroupFactory
    add("--normalization", type=str, default="LayerNorm", choices=("LayerNorm", "RMSNorm"))
    add("--norm-epsilon", type=float, default=1e-5, dest="layernorm_epsilon")
    add("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    add("--add-qkv-bias", action="store_true")
    add("--position-embedding-type", type=str, default="learned_absolute",
        choices=["learned_absolute", "rope", "mrope", "relative", "none"])
    add("--rotary-base", type=int, default=10000)
    add("--rotary-percent", type=float, default=1.0)
    add("--use-rope-scaling", action="store_true")
    add("--rope-scaling-factor", type=float, default=8.0)
    add("--seq-length", type=int, default=None)
    add("--max-position-embeddings", type=int, default=None)
    add("--micro-batch-size", type=int, default=None)
    add("--global-batch-size", type=int, default=None)
    add("--recompute-granularity", type=str, default=None, choices=["full", "selective"])
    add("--recompute-method", type=str, default=None, choices=["uniform", "block"])
    add("--recompute-num-layers", type=int, default=None)
    add("--use-distributed-optimizer", action="store_true")
    add("--use-megatron-fsdp", action="store_true")
    add("--data-parallel-sharding-strategy", type=str, default="optim_grads_params",
        choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])
    add("--ckpt-format", default="torch_dist", choices=["torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"])
    add("--outer-dp-sharding-strategy", type=str, default="no_shard", choices=["no_shard", "optim"])
    add("--num-distributed-optimizer-instances", type=int, default=1)
    add("--overlap-grad-reduce", action="store_true", default=False)
    add("--overlap-param-gather", action="store_true", default=False)
    add("--bf16", action="store_true")
    add("--grad-reduce-in-bf16", action="store_true")
    add("--accumulate-allreduce-grads-in-fp32", action="store_true")
    add("--fp16", action="store_true")
    add("--fp8-format", default=None, choices=["e4m3", "hybrid"], dest="fp8")
    add("--fp8-recipe", default="delayed", choices=["tensorwise", "delayed", "mxfp8", "blockwise", "custom"])
    add("--fp8-amax-history-len", type=int, default=1)
    add("--fp8-amax-compute-algo", default="most_recent", choices=["most_recent", "max"])
    # what launch_command leaves to placeholders
    add("--data-path", nargs="*", default=None)
    add("--tokenizer-type", type=str, default=None, choices=[
        "BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
        "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer", "MultimodalTokenizer",
        "NullTokenizer", "NullMultimodalTokenizer", "SFTTokenizer"])
    add("--tokenizer-model", type=str, default=None)
    add("--train-iters", type=int, default=None)
    add("--lr", type=float, default=None)
    return parser


def parse(args: list[str]) -> argparse.Namespace:
    namespace = megatron_lm_parser().parse_args(args)  # unknown or malformed flags raise
    # Megatron-LM's validate_args: the virtual pipeline size from whichever flag gives it
    if namespace.pipeline_model_parallel_layout is not None:
        stages = PipelineParallelLayerLayout.get_num_stages_from_str(namespace.pipeline_model_parallel_layout)
        vpp = stages // namespace.pipeline_model_parallel_size
    else:
        vpp = namespace.num_virtual_stages_per_pipeline_rank
    namespace.virtual_pipeline_model_parallel_size = vpp if vpp and vpp > 1 else None
    return namespace


def validate_like_megatron_lm(ns: argparse.Namespace) -> None:
    """The rules of Megatron-LM's validate_args that concern the emitted flags (copied, not imported)."""
    assert (
        int(ns.num_layers_per_virtual_pipeline_stage is not None)
        + int(ns.num_virtual_stages_per_pipeline_rank is not None)
        + int(ns.pipeline_model_parallel_layout is not None)
    ) <= 1
    if ns.pipeline_model_parallel_layout is not None:
        stages = PipelineParallelLayerLayout.get_num_stages_from_str(ns.pipeline_model_parallel_layout)
        assert stages % ns.pipeline_model_parallel_size == 0
    elif ns.num_layers_per_virtual_pipeline_stage is not None:
        assert ns.decoder_first_pipeline_num_layers is None and ns.decoder_last_pipeline_num_layers is None
    elif ns.num_virtual_stages_per_pipeline_rank is None and (
        ns.decoder_first_pipeline_num_layers is None and ns.decoder_last_pipeline_num_layers is None
    ):
        assert ns.num_layers % ns.pipeline_model_parallel_size == 0
    if ns.virtual_pipeline_model_parallel_size is not None:
        if ns.overlap_p2p_comm:
            assert ns.pipeline_model_parallel_size > 1
        else:
            assert ns.pipeline_model_parallel_size > 2
    else:
        ns.overlap_p2p_comm = False  # not overlapped without the interleaved schedule
    if ns.seq_length is not None and ns.context_parallel_size > 1:
        assert ns.seq_length % (ns.context_parallel_size * 2) == 0, "seq-length should be a multiple of 2 * cp"
    if ns.use_megatron_fsdp:
        assert ns.ckpt_format == "fsdp_dtensor", "Megatron-FSDP requires the `fsdp_dtensor` checkpointing format."
        ns.use_distributed_optimizer = True  # Megatron-FSDP v1 runs under the distributed optimizer
    if ns.overlap_param_gather:
        assert ns.use_distributed_optimizer or ns.use_megatron_fsdp, \
            "--overlap-param-gather only supported with distributed optimizer, megatron fsdp"
        assert ns.overlap_grad_reduce, "--overlap-grad-reduce should be turned on when using --overlap-param-gather"
    assert not (ns.bf16 and ns.fp16)
    if ns.bf16:  # bf16 gradients only when asked; fp32 accumulation and reduction otherwise
        ns.accumulate_allreduce_grads_in_fp32 = not ns.grad_reduce_in_bf16
    assert ns.max_position_embeddings >= ns.seq_length
    if ns.recompute_granularity == "selective":
        assert ns.recompute_method is None
    assert ns.tensor_model_parallel_size > 1 or not ns.sequence_parallel
    if ns.tp_comm_overlap:  # validate_args, after turning sequence parallelism off at tp 1
        assert ns.sequence_parallel, "Tensor parallel communication/GEMM overlap can happen only when sequence " \
                                     "parallelism is enabled"
    if ns.expert_tensor_parallel_size is None:  # validate_args: expert-TP defaults to TP
        ns.expert_tensor_parallel_size = ns.tensor_model_parallel_size
    if ns.add_bias_linear:  # validate_args keeps the two in sync
        ns.add_qkv_bias = True


def transformer_config(ns: argparse.Namespace) -> TransformerConfig:
    """As Megatron-LM's core_transformer_config_from_args builds it (for these flags; MLATransformerConfig with
    --multi-latent-attention, and a rope_type left unset to the config class's default); __post_init__
    validates."""
    config_class = MLATransformerConfig if ns.multi_latent_attention else TransformerConfig
    kwargs = {f.name: getattr(ns, f.name) for f in dataclasses.fields(config_class) if hasattr(ns, f.name)}
    if ns.rope_type is None:
        kwargs.pop("rope_type", None)
    else:
        assert ns.multi_latent_attention or ns.rope_type == "rope"
    kwargs.update(
        pipeline_dtype=torch.float16 if ns.fp16 else torch.bfloat16,
        batch_p2p_comm=not ns.overlap_p2p_comm,
        num_layers_in_first_pipeline_stage=ns.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=ns.decoder_last_pipeline_num_layers,
        num_query_groups=ns.num_query_groups if ns.group_query_attention else None,
        num_moe_experts=ns.num_experts,
    )
    if ns.swiglu:
        kwargs.update(activation_func=F.silu, gated_linear_unit=True)
    return config_class(**kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Reading the adapter's outputs back


def rendered_args(text: str) -> list[str]:
    lines = text.splitlines()
    start, end = lines.index("MEGATRON_ARGS=("), lines.index(")")
    return shlex.split(" ".join(lines[start + 1:end]))


def launched(command: str) -> tuple[list[str], list[str]]:
    """(pretrain_gpt.py arguments, global rank -> device) that this torchrun launch starts.

    torchrun numbers ranks by NODE_RANK, each node's local ranks in order;
    local rank i runs on the i-th GPU of CUDA_VISIBLE_DEVICES (all GPUs in
    order when it is not set).
    """
    nodes = [(int(k), int(node), int(count), [int(g) for g in gpus.split(",")])
             for k, node, count, gpus in re.findall(r"#   NODE_RANK=(\d+): node (\d+), (\d+) ranks on GPUs ([\d,]+)", command)]
    visible = {int(k): [int(g) for g in gpus.split(",")]
               for k, gpus in re.findall(r"^  (\d+)\) .*CUDA_VISIBLE_DEVICES=([\d,]+) ;;", command, re.MULTILINE)}
    nproc = {int(k): int(n) for k, n in re.findall(r"^  (\d+)\) NPROC_PER_NODE=(\d+);", command, re.MULTILINE)}
    torchrun = command[command.index("torchrun "):].replace("\\\n", " ")
    words = shlex.split(torchrun)
    flag = words[words.index("--nproc-per-node") + 1]
    assert words[words.index("--nnodes") + 1] == str(len(nodes))
    devices = []
    for k, node, count, gpus in nodes:
        local = nproc[k] if flag.startswith("${NPROC_PER_NODE") else int(flag)
        gpu_list = visible.get(k, list(range(local)))
        assert local == count == len(gpu_list) and gpu_list == gpus
        devices += [f"{node}:{gpu}" for gpu in gpu_list]
    script_args = words[words.index(megatron.ENTRY_SCRIPT) + 1:]
    # the still-required settings close the command, each read from its variable or stopping bash
    placeholders = script_args[len(script_args) - 2 * len(megatron.REQUIRED):]
    assert placeholders[0::2] == [setting.flag for setting in megatron.REQUIRED]
    assert all(word.startswith(f"${{{setting.variable}:?") for word, setting in zip(placeholders[1::2], megatron.REQUIRED))
    return script_args[:len(script_args) - len(placeholders)], devices


# ---------------------------------------------------------------------------------------------------------------
# megatron-core's checks


def expected_layers(plan: Plan, stage: int, chunk: int) -> list[int]:
    """Plan semantics: chunk c of stage s is virtual stage c*p + s; virtual stages hold consecutive layers, a stage's
    chunks its `chunk_layers` each, else its layers / v."""
    replica = plan.replicas[0]
    p, v = len(replica.stages), plan.virtual_stages

    def size(s: int, c: int) -> int:
        given = replica.stages[s].chunk_layers
        return given[c] if given is not None else (replica.stages[s].layers[1] - replica.stages[s].layers[0]) // v

    start = sum(size(k % p, k // p) for k in range(chunk * p + stage))
    return list(range(start, start + size(stage, chunk)))


def megatron_layers(config: TransformerConfig, stage: int, chunk: int | None) -> list[int]:
    if config.pipeline_model_parallel_layout is not None:
        return config.pipeline_model_parallel_layout.get_layer_id_list(vp_stage=chunk, pp_rank=stage)
    offset = get_transformer_layer_offset(config, vp_stage=chunk, pp_rank=stage)
    return list(range(offset, offset + get_num_layers_to_build(config, vp_stage=chunk, pp_rank=stage)))


def megatron_order(num_microbatches: int, chunks: int, group: int, warmup: int) -> list[Op]:
    """megatron-core's (interleaved) 1F1B order on one pipeline rank, as plan ops."""
    table = get_schedule_table(num_microbatches, chunks, group)
    forwards = [Op("F", mb, c) for mb, c in table]
    backwards = [Op("B", mb, chunks - 1 - c) for mb, c in table]
    steady = len(table) - warmup
    order = forwards[:warmup]
    for k in range(steady):
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[steady:]


def check_rank(plan: Plan, ns: argparse.Namespace, config: TransformerConfig, devices: list[str], rank: int) -> None:
    """One rank's view after initialize_model_parallel, against the plan."""
    replicas = sorted(plan.replicas, key=lambda r: r.id)
    tp, cp, pp, dp = replicas[0].stages[0].tp, replicas[0].stages[0].cp, len(replicas[0].stages), len(replicas)
    v = plan.virtual_stages
    assert parallel_state.get_tensor_model_parallel_world_size() == tp
    assert parallel_state.get_context_parallel_world_size() == cp
    assert parallel_state.get_pipeline_model_parallel_world_size() == pp
    assert parallel_state.get_data_parallel_world_size() == dp
    assert parallel_state.get_virtual_pipeline_model_parallel_world_size() == (v if v > 1 else None)

    # a stage's devices: tp consecutive ones per CP rank
    where = {d: (r, s, t) for r, replica in enumerate(replicas) for s, stage in enumerate(replica.stages)
             for t, d in enumerate(stage.devices)}
    r, s, t = where[devices[rank]]
    c, t_rank = divmod(t, tp)
    assert parallel_state.get_tensor_model_parallel_rank() == t_rank
    assert parallel_state.get_context_parallel_rank() == c
    assert parallel_state.get_pipeline_model_parallel_rank() == s
    assert parallel_state.get_data_parallel_rank() == r

    def group_devices(group) -> list[str]:
        return [devices[g] for g in dist.get_process_group_ranks(group)]

    stage_devices = replicas[r].stages[s].devices
    assert group_devices(parallel_state.get_tensor_model_parallel_group()) == stage_devices[c * tp:(c + 1) * tp]
    assert group_devices(parallel_state.get_context_parallel_group()) == stage_devices[t_rank::tp]
    assert group_devices(parallel_state.get_pipeline_model_parallel_group()) == [st.devices[t] for st in replicas[r].stages]
    assert group_devices(parallel_state.get_data_parallel_group()) == [rep.stages[s].devices[t] for rep in replicas]
    # gradients are reduced (and ZeRO shards) over the replicas' CP ranks together
    assert sorted(group_devices(parallel_state.get_data_parallel_group(with_context_parallel=True))) == sorted(
        rep.stages[s].devices[cc * tp + t_rank] for rep in replicas for cc in range(cp))

    # hybrid sharding: megatron-core's distributed-optimizer instance holding this rank shards its state over the
    # plan's shard group (dp_shard consecutive replicas, with their CP ranks), the group priced and counted
    shard = plan.dp_shard if plan.zero_stage >= 1 and plan.dp_shard else dp
    if shard < dp:
        group = replicas[(r // shard) * shard:(r // shard + 1) * shard]
        assert sorted(group_devices(parallel_state.get_data_parallel_group(
            with_context_parallel=True, partial_data_parallel=True))) == sorted(
            rep.stages[s].devices[cc * tp + t_rank] for rep in group for cc in range(cp))
        assert len(group_devices(parallel_state.get_inter_distributed_optimizer_instance_group())) == dp // shard

    # expert parallelism in megatron-core's expert rank order over the stage's ranks q = t + tp (c + cp r): the EP
    # group is the ep ranks etp apart in this rank's block of etp x ep, each expert split over etp consecutive
    # ranks (the groups priced: a replica's CP ranks first, then consecutive replicas)
    ep, etp = plan.ep, plan.etp or tp
    assert parallel_state.get_expert_model_parallel_world_size() == ep
    assert parallel_state.get_expert_tensor_parallel_world_size() == etp
    q = t_rank + tp * (c + cp * r)

    def device_of(stage_rank: int) -> str:
        replica, rest = divmod(stage_rank, tp * cp)
        return replicas[replica].stages[s].devices[rest]

    if ep > 1:
        first = q - q % (etp * ep) + q % etp
        assert group_devices(parallel_state.get_expert_model_parallel_group()) == [
            device_of(first + e * etp) for e in range(ep)]
    if ep > 1 and shard < dp:
        # hybrid sharding: the experts' state is sharded over megatron-core's partial expert data-parallel group, the
        # ranks of this rank's shard group (its block of tp x cp x dp_shard stage ranks) holding the same experts
        block = tp * cp * shard
        first_of_group = q - q % block
        assert sorted(group_devices(parallel_state.get_expert_data_parallel_group(partial_expert_data_parallel=True))) == (
            sorted(device_of(x) for x in range(first_of_group, first_of_group + block) if x % (etp * ep) == q % (etp * ep)))
    if etp > 1:
        assert group_devices(parallel_state.get_expert_tensor_parallel_group()) == [
            device_of(q - q % etp + u) for u in range(etp)]

    # the layers this pipeline rank builds, chunk by chunk
    for chunk in range(v):
        assert megatron_layers(config, s, chunk if v > 1 else None) == expected_layers(plan, s, chunk), (s, chunk)
    if v == 1:
        assert expected_layers(plan, s, 0) == list(range(*replicas[0].stages[s].layers))

    # the order megatron-core runs this rank's microbatches in, against the plan's timeline
    if plan.schedule in ("1f1b", "interleaved"):
        m = replicas[0].num_microbatches
        group = config.microbatch_group_size_per_vp_stage
        _, _, warmup, _ = get_pp_rank_microbatches(m, v, group)
        timeline = next(e for e in plan.pipeline_schedule.replicas if replicas[r].id in e.replica_ids)
        assert [parse_op(label) for label in timeline.stages[s].ops] == megatron_order(m, v, group, warmup)


def ranks_to_check(plan: Plan, devices: list[str]) -> list[int]:
    """A rank of every pipeline stage (spread over replicas and TP positions), and the last rank."""
    rank_of = {d: i for i, d in enumerate(devices)}
    replicas = sorted(plan.replicas, key=lambda r: r.id)
    picked = {len(devices) - 1}
    for s in range(len(replicas[0].stages)):
        stage = replicas[(3 * s + 1) % len(replicas)].stages[s]
        picked.add(rank_of[stage.devices[(s * (stage.tp + 1)) % len(stage.devices)]])  # varied TP and CP ranks
    return sorted(picked)


def run_megatron_core(plan: Plan, ns: argparse.Namespace, devices: list[str], ranks: list[int]) -> TransformerConfig:
    """megatron-core's own checks; raises whatever megatron-core raises."""
    config = transformer_config(ns)
    world = len(devices)
    order = "tp-cp-ep-pp-dp" if ns.use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp"
    for rank in ranks:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=ns.tensor_model_parallel_size,
                pipeline_model_parallel_size=ns.pipeline_model_parallel_size,
                context_parallel_size=ns.context_parallel_size,
                expert_model_parallel_size=ns.expert_model_parallel_size,
                expert_tensor_parallel_size=ns.expert_tensor_parallel_size,
                virtual_pipeline_model_parallel_size=ns.virtual_pipeline_model_parallel_size,
                num_distributed_optimizer_instances=ns.num_distributed_optimizer_instances,
                order=order,
                create_gloo_process_groups=False,
            )
            init_num_microbatches_calculator(
                rank, None, ns.global_batch_size, ns.micro_batch_size, parallel_state.get_data_parallel_world_size()
            )
            assert get_num_microbatches() == plan.replicas[0].num_microbatches
            check_rank(plan, ns, config, devices, rank)
        finally:
            destroy_num_microbatches_calculator()
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
    return config


# ---------------------------------------------------------------------------------------------------------------
# Real plans: accepted by megatron-core, and set up as planned


@pytest.mark.parametrize("name", list(PLANS))
def test_megatron_core_runs_the_plan(name):
    plan = real_plan(name)
    args = megatron.megatron_args(plan)
    assert rendered_args(megatron.render(plan)) == args
    assert export_format("megatron").render(plan) == megatron.render(plan)
    launch_args, devices = launched(megatron.launch_command(plan))
    assert launch_args == args
    assert devices == list(megatron.rank_devices(plan))
    assert sorted(devices) == sorted(d for r in plan.replicas for s in r.stages for d in s.devices)

    ns = parse(args)
    validate_like_megatron_lm(ns)
    config = run_megatron_core(plan, ns, devices, ranks_to_check(plan, devices))
    # the config megatron-core accepted is the plan's
    arch = plan.architecture
    assert (config.num_layers, config.hidden_size, config.ffn_hidden_size) == (
        arch.num_layers, arch.hidden_size, arch.ffn_hidden_size)
    assert config.num_attention_heads == arch.num_attention_heads
    # heads as wide as planned (megatron-core's default is hidden / heads), query/key norms where the model has them
    assert config.kv_channels == (arch.head_dim or arch.hidden_size // arch.num_attention_heads)
    assert config.qk_layernorm == arch.qk_norm
    assert config.num_query_groups == (arch.num_kv_heads or arch.num_attention_heads)
    assert config.sequence_parallel == (config.tensor_model_parallel_size > 1)
    assert config.recompute_granularity == {"none": None}.get(plan.recompute, plan.recompute)
    assert config.gated_linear_unit == arch.swiglu
    assert ns.untie_embeddings_and_output_weights == (not arch.tied_embeddings)
    # the architecture Megatron builds is the plan's: norms, RoPE, biases (not Megatron's GPT defaults)
    assert (config.normalization, config.layernorm_epsilon) == (
        {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"}[arch.normalization], arch.norm_epsilon)
    assert (ns.position_embedding_type, ns.rotary_base) == ("rope", arch.rope_theta)
    assert ns.use_rope_scaling == (arch.rope_scaling is not None)
    assert (config.add_bias_linear, config.add_qkv_bias) == (arch.linear_bias, arch.qkv_bias or arch.linear_bias)
    assert ns.use_distributed_optimizer == (plan.zero_stage >= 1)
    # a mixture of experts as planned: experts, top-k, expert and shared widths, expert parallelism
    assert (config.num_moe_experts, config.moe_router_topk) == (
        (arch.num_experts, arch.experts_per_token) if arch.num_experts else (None, 2))
    if arch.num_experts:
        assert config.moe_ffn_hidden_size == arch.ffn_hidden_size
        assert config.moe_shared_expert_intermediate_size == (arch.shared_expert_ffn_hidden_size or None)
        assert config.expert_model_parallel_size == plan.ep
        # the dispatcher the plan prices, not megatron-core's default all-gather one
        assert config.moe_token_dispatcher_type == ("flex" if plan.moe_dispatcher == "flex" else "alltoall")
        assert config.moe_flex_dispatcher_backend == "deepep"
    # ZeRO-2/3 as Megatron-FSDP: megatron-core's own DDP config takes the strategy, and its
    # ShardingStrategy numbers it as the plan's stage
    assert ns.use_megatron_fsdp == (plan.zero_stage >= 2)
    # the gradient buffer's dtype: megatron-core's DDP keeps it in fp32 when grad_reduce_in_fp32 (Megatron-LM passes
    # accumulate_allreduce_grads_in_fp32), else in the weights' bf16 (distributed_data_parallel.py `grad_dtype`):
    # the 4 or 2 bytes a parameter the memory model counts for the plan's grad_precision
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=ns.accumulate_allreduce_grads_in_fp32)
    if plan.precision != "fp16":
        assert ddp.grad_reduce_in_fp32 == (plan.grad_precision != "bf16")
    hybrid = plan.zero_stage >= 1 and plan.dp_shard is not None and plan.dp_shard < len(plan.replicas)
    assert ns.num_distributed_optimizer_instances == (len(plan.replicas) // plan.dp_shard if hybrid else 1)
    if ns.use_megatron_fsdp:
        ddp = DistributedDataParallelConfig(
            use_megatron_fsdp=True, use_distributed_optimizer=True, overlap_grad_reduce=ns.overlap_grad_reduce,
            overlap_param_gather=ns.overlap_param_gather, data_parallel_sharding_strategy=ns.data_parallel_sharding_strategy)
        assert ShardingStrategy[ddp.data_parallel_sharding_strategy.upper()] == plan.zero_stage
    assert (ns.seq_length, ns.micro_batch_size, ns.global_batch_size) == (
        plan.seq_length, plan.micro_batch_size, plan.global_batch_size)
    # FP8 as planned: Transformer Engine's hybrid format with delayed scaling, over bf16
    fp8 = plan.precision == "fp8"
    assert (config.fp8, ns.bf16) == ("hybrid" if fp8 else None, plan.precision != "fp16")
    if fp8:
        assert (config.fp8_recipe, config.fp8_amax_history_len, config.fp8_amax_compute_algo) == (
            "delayed", 1024, "max")


def test_cases_cover_the_flag_variants():
    """The parametrized plans exercise every way the adapter expresses a layout."""
    flags = {name: megatron.megatron_args(real_plan(name)) for name in PLANS}
    assert "--num-virtual-stages-per-pipeline-rank" in flags["healthy-interleaved-70b"]
    assert {"--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"} <= set(flags["uneven-first-last"])
    last_only = flags["uneven-last-only"]
    assert "--decoder-last-pipeline-num-layers" in last_only and "--decoder-first-pipeline-num-layers" not in last_only
    assert "--pipeline-model-parallel-layout" in flags["recompute-full-layout"]
    assert "--use-tp-pp-dp-mapping" in flags["replica-major"]
    assert "--group-query-attention" in flags["gqa-llama3-8b"]
    assert "--add-qkv-bias" in flags["uneven-first-last"]  # qwen2.5-32b
    assert flags["gqa-llama3-8b"][flags["gqa-llama3-8b"].index("--rotary-base") + 1] == "500000"
    recompute = {name: real_plan(name).recompute for name in PLANS if name.startswith("recompute-")}
    assert sorted(recompute.values()) == ["full", "none", "selective"]
    assert "NPROC_PER_NODE=6" in megatron.launch_command(real_plan("failed-gpu"))
    assert "--fp8-format" in flags["fp8-h100"] and all("--fp8-format" not in f for n, f in flags.items() if n != "fp8-h100")
    fsdp = {name for name, f in flags.items() if "--use-megatron-fsdp" in f}
    assert fsdp >= {"zero2-fsdp", "zero3-fsdp", "zero3-hybrid"}
    assert {real_plan(name).zero_stage for name in fsdp} == {2, 3}
    # hybrid sharding: Megatron-FSDP's HSDP (searched) and the partial distributed optimizer (a fixed layout)
    instances = {name for name, f in flags.items() if "--num-distributed-optimizer-instances" in f}
    assert instances >= {"zero3-hybrid", "zero1-partial-instances", "moe-ep-partial-instances"}
    hybrid = real_plan("zero3-hybrid")  # sharded over the replicas of one node: 8 GPUs / TP
    tp = {stage.tp for replica in hybrid.replicas for stage in replica.stages}
    assert len(tp) == 1 and 1 < hybrid.dp_shard == 8 // tp.pop() < len(hybrid.replicas)
    assert {name for name, f in flags.items() if "--outer-dp-sharding-strategy" in f} == instances & fsdp
    assert real_plan("zero1-partial-instances").zero_stage == 1
    assert real_plan("zero1-partial-instances").replicas[0].stages[0].cp == 2
    moe = {name for name, f in flags.items() if "--num-experts" in f}
    assert moe == {"moe-experts-over-tp", "moe-expert-parallel", "moe-expert-tp-1", "moe-a2a-overlap", "moe-expert-cp",
                   "moe-flex-dispatcher", "qwen3-moe", "moe-ep-partial-instances"}
    assert real_plan("moe-ep-partial-instances").ep == 4 and real_plan("moe-ep-partial-instances").dp_shard == 2
    assert real_plan("moe-expert-cp").ep == 4 and real_plan("moe-expert-cp").replicas[0].stages[0].cp == 2
    overlapped = {name for name, f in flags.items() if "--overlap-moe-expert-parallel-comm" in f}
    assert overlapped == {"moe-a2a-overlap"} and real_plan("moe-a2a-overlap").moe_a2a_overlap
    assert real_plan("moe-expert-tp-1").etp == 1 and "--expert-tensor-parallel-size" in flags["moe-expert-tp-1"]
    assert {"--kv-channels", "--qk-layernorm"} <= set(flags["qwen3-moe"])
    assert real_plan("moe-experts-over-tp").replicas[0].stages[0].tp > 1
    assert real_plan("moe-expert-parallel").ep > 1
    assert {name for name, f in flags.items() if "--grad-reduce-in-bf16" in f} == {"bf16-grads"}
    assert {name for name, f in flags.items() if "--tp-comm-overlap" in f} == {"tp-comm-overlap"}
    assert real_plan("tp-comm-overlap").tp_comm_overlap == "megatron"


@pytest.mark.parametrize("tp,ep,shared,head_dim,etp", [(1, 1, 0, None, None), (2, 1, 128, None, None),
                                                       (4, 1, 0, 64, None), (1, 4, 0, None, None),
                                                       (2, 2, 128, 64, None), (2, 2, 128, None, 1), (4, 4, 0, None, 2)])
def test_megatron_core_builds_the_experts_the_memory_model_counts(tp, ep, shared, head_dim, etp):
    """One mixture-of-experts layer as megatron-core builds it on one rank (its local spec, experts
    split over `ep` and sharded over TP as the export asks): the weights the memory model gives a GPU
    (`cost_models.expert_parallel.layer_params_per_gpu`) are the ones megatron-core allocates, its share of
    every expert included, up to the norms and router it replicates on each TP rank. With `head_dim` (64:
    8 heads 512 wide over a hidden size of 256) the heads are wider than hidden / heads and normalize their
    queries and keys, as Qwen3's do. With `etp` (--expert-tensor-parallel-size) each expert is split over etp
    GPUs instead of TP."""
    from cost_models.expert_parallel import layer_params_per_gpu

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from cost_models.model_spec import ModelSpec

    spec = ModelSpec("tiny-moe", num_layers=2, hidden_size=256, ffn_hidden_size=384, num_attention_heads=8,
                     num_kv_heads=2, vocab_size=1000, swiglu=True, tied_embeddings=False, num_experts=4,
                     experts_per_token=2, shared_expert_ffn_hidden_size=shared, head_dim=head_dim,
                     qk_norm=head_dim is not None)
    expert_tp = tp if etp is None else etp
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp * ep * expert_tp)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                                 expert_tensor_parallel_size=etp, create_gloo_process_groups=False)
        config = TransformerConfig(
            num_layers=2, hidden_size=256, ffn_hidden_size=384, num_attention_heads=8, num_query_groups=2,
            kv_channels=head_dim, qk_layernorm=head_dim is not None,
            num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=384,
            moe_shared_expert_intermediate_size=shared or None, add_bias_linear=False, gated_linear_unit=True,
            activation_func=F.silu, normalization="RMSNorm", use_cpu_initialization=True,
            tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=expert_tp,
            params_dtype=torch.float32)
        layer_spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False, normalization="RMSNorm",
                                              qk_layernorm=head_dim is not None)
        layer = TransformerLayer(config, layer_spec.submodules, layer_number=1)
        built = sum(p.numel() for p in layer.parameters())
        experts = sum(p.numel() for n, p in layer.named_parameters() if ".local_experts." in n)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    assert experts == spec.routed_expert_params_per_layer / (expert_tp * ep)  # 4 / ep experts, each over expert-TP
    # router, two norms and the query/key norms, whole on every TP rank
    replicated = spec.hidden_size * spec.num_experts + 2 * spec.hidden_size + (2 * head_dim if head_dim else 0)
    counted = layer_params_per_gpu(spec, tp, ep, etp)
    assert built == counted - replicated / tp + replicated
    assert abs(counted - built) / built < 0.01


# ---------------------------------------------------------------------------------------------------------------
# Broken plans: megatron-core's own checks reject them (so the checks above are live)


def _check_broken(plan: Plan) -> None:
    args = megatron.megatron_args(plan)
    _, devices = launched(megatron.launch_command(plan))
    run_megatron_core(plan, parse(args), devices, ranks_to_check(plan, devices))


def _regroup_tp(plan: Plan, tp: int) -> Plan:
    """A pp=1 plan with its devices regrouped into TP groups of `tp` per node (leftovers unused)."""
    devices = sorted((d for r in plan.replicas for s in r.stages for d in s.devices),
                     key=lambda d: tuple(map(int, d.split(":"))))
    by_node: dict[str, list[str]] = {}
    for device in devices:
        by_node.setdefault(device.split(":")[0], []).append(device)
    groups, unused = [], list(plan.unused_devices)
    for node_devices in by_node.values():
        whole = len(node_devices) // tp * tp
        groups += [node_devices[i:i + tp] for i in range(0, whole, tp)]
        unused += node_devices[whole:]
    template = plan.replicas[0]
    replicas = [
        template.model_copy(update={"id": i, "stages": [template.stages[0].model_copy(update={"devices": g, "tp": tp})]})
        for i, g in enumerate(groups)
    ]
    batch = len(replicas) * template.num_microbatches * plan.micro_batch_size
    return plan.model_copy(update={"replicas": replicas, "unused_devices": unused, "global_batch_size": batch})


def test_megatron_core_rejects_tp_that_does_not_divide_the_heads():
    plan = _regroup_tp(_example("healthy-32xa100-llama2-7b"), 3)  # 32 heads
    assert "--tensor-model-parallel-size 3" in megatron.render(plan)
    with pytest.raises(ValueError, match=r"num_attention_heads \(32\) must be a multiple of tensor_model_parallel_size \(3\)"):
        _check_broken(plan)


def test_megatron_core_rejects_a_batch_not_divisible_by_micro_batch_times_dp():
    plan = real_plan("recompute-none")
    broken = plan.model_copy(update={"global_batch_size": plan.global_batch_size + 1})
    with pytest.raises(AssertionError, match="is not divisible by micro batch size"):
        _check_broken(broken)


def test_megatron_core_rejects_pp_that_does_not_divide_the_layers():
    plan = real_plan("recompute-none")  # pp 2, 16 + 16 layers: no uneven-split flags
    broken = plan.model_copy(update={"architecture": plan.architecture.model_copy(update={"num_layers": 33})})
    args = megatron.megatron_args(broken)
    assert not {"--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                "--pipeline-model-parallel-layout"} & set(args)
    with pytest.raises(AssertionError, match="divisible by pipeline_model_parallel_size"):
        _check_broken(broken)


def test_megatron_core_rejects_a_layout_that_misses_layers():
    plan = real_plan("recompute-full-layout")  # 8, 7, 9, 8 of 32 layers
    broken = plan.model_copy(update={"architecture": plan.architecture.model_copy(update={"num_layers": 31})})
    with pytest.raises(AssertionError, match="must match num_layers 31"):
        _check_broken(broken)


# ---------------------------------------------------------------------------------------------------------------
# Refusals by the adapter


@cache
def _non_uniform_plan() -> Plan:
    request = small_request(model="llama2-13b", training={"global_batch_size": 64, "seq_length": 8192},
                            failures={"failed": ["0:3", "0:4", "0:5"]})
    return plan_for(PlanRequest.model_validate(request))


@pytest.mark.parametrize("export", [megatron.render, megatron.launch_command, megatron.megatron_args])
def test_non_uniform_plan_is_refused_naming_what_differs(export):
    plan = _non_uniform_plan()
    assert not plan.uniform
    with pytest.raises(ExportError) as refused:
        export(plan)
    message = str(refused.value)
    assert "Megatron-LM cannot run this plan" in message
    assert '"allow_non_uniform": false' in message
    tps = {s.tp for r in plan.replicas for s in r.stages}
    if len(tps) > 1:
        assert f"stages use different TP sizes ({', '.join(map(str, sorted(tps)))})" in message
    if len({len(r.stages) for r in plan.replicas}) > 1:
        assert "replicas have different stage counts" in message
    if len({r.num_microbatches for r in plan.replicas}) > 1:
        assert "replicas run different microbatch counts" in message


def test_zero_bubble_schedule_is_refused():
    request = small_request(options={**STOCK, "schedules": ["zb-h1"]}, failures={"failed": ["1:3"]})
    plan = plan_for(PlanRequest.model_validate(request))
    assert plan.uniform and plan.schedule == "zb-h1"
    with pytest.raises(ExportError, match=r'pipeline schedule "zb-h1" is not one Megatron-LM runs'):
        megatron.megatron_args(plan)


def test_unknown_replica_is_refused():
    with pytest.raises(ExportError, match="plan has no replica 99"):
        megatron.render(real_plan("recompute-none"), 99)


@pytest.mark.parametrize(("m", "p", "group"), [(8, 4, None), (10, 4, 5), (12, 5, 6), (9, 4, "refused"), (3, 4, "refused")])
def test_interleaved_microbatch_groups_match_megatron_core(m, p, group):
    """The plan's interleaved groups as megatron-core's group size, or refused when no size reproduces them."""
    layout = dataclasses.replace(megatron.stock(real_plan("recompute-selective-interleaved")), pp=p, num_microbatches=m)
    if group == "refused":
        with pytest.raises(ExportError, match="groups of one size"):
            megatron._microbatch_group(layout)
        return
    assert megatron._microbatch_group(layout) == group
    v = layout.virtual_stages
    planned = [op for op in interleaved_1f1b(p, m, v).orders[0] if op.kind == "F"]
    table = get_schedule_table(m, v, group or p)
    assert [(op.microbatch, op.chunk) for op in planned] == table


def test_uneven_interleaved_layout_is_what_megatron_core_builds():
    """An uneven split with v = 2 has no first/last flags to express it: the layout string, as megatron-core reads it."""
    layout = dataclasses.replace(
        megatron.stock(real_plan("recompute-full-layout")), layers_per_stage=(4, 6, 2), pp=3, virtual_stages=2
    )
    text = megatron._pipeline_layout(layout.chunk_layers("megatron"))
    assert text == "Et*2|t*3|t|t*2|t*3|tL"
    config = TransformerConfig(num_layers=12, hidden_size=64, num_attention_heads=8, pipeline_model_parallel_size=3,
                               pipeline_model_parallel_layout=text, pipeline_dtype=torch.bfloat16, bf16=True)
    assert config.virtual_pipeline_model_parallel_size == 2
    built = config.pipeline_model_parallel_layout.layout  # [pp rank][chunk] -> layer types
    assert [[chunk.count(LayerType.decoder) for chunk in rank] for rank in built] == [[2, 2], [3, 3], [1, 1]]


def test_rank_order_falls_back_to_tp_pp_dp_and_refuses_what_torchrun_cannot_place():
    plan = real_plan("replica-major")
    layout = megatron.stock(plan)
    order, _ = megatron.rank_order(layout)
    assert order == "tp-pp-dp"
    assert megatron.node_blocks(layout.rank_devices) is None  # the default order splits nodes
    # a node split across non-contiguous ranks in both orders: swap one device between nodes 0 and 1
    replicas = [r.model_copy(deep=True) for r in plan.replicas]
    replicas[0].stages[1].devices[0], replicas[2].stages[0].devices[0] = (
        replicas[2].stages[0].devices[0], replicas[0].stages[1].devices[0])
    with pytest.raises(ExportError, match="cannot place this plan's ranks"):
        megatron.megatron_args(plan.model_copy(update={"replicas": replicas}))


@pytest.mark.parametrize(("ep", "pp", "v", "recompute"), [
    (4, 1, 1, "none"), (4, 4, 2, "selective"), (4, 4, 1, "none"), (4, 1, 1, "full"), (1, 1, 1, "none"),
    (4, 2, 4, "none"), (4, 2, 2, "full"),
])
def test_the_ep_overlap_is_priced_exactly_where_megatron_core_accepts_it(ep, pp, v, recompute):
    """`cost_models.expert_parallel.a2a_overlap_applies` against megatron-core's own check of
    --overlap-moe-expert-parallel-comm (TransformerConfig.__post_init__), for the options it reads."""
    from cost_models.expert_parallel import a2a_overlap_applies

    recompute_args = {"full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
                      "selective": dict(recompute_granularity="selective")}.get(recompute, {})
    try:
        TransformerConfig(num_layers=8, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_router_topk=2,
                          expert_model_parallel_size=ep, pipeline_model_parallel_size=pp,
                          virtual_pipeline_model_parallel_size=v if v > 1 else None, pipeline_dtype=torch.bfloat16,
                          moe_token_dispatcher_type="alltoall", bf16=True, overlap_moe_expert_parallel_comm=True,
                          **recompute_args)
        accepted = True
    except (AssertionError, ValueError):
        accepted = False
    assert a2a_overlap_applies(ep, pp, v, recompute) == accepted


def test_megatron_refuses_pytorch_async_tp():
    """PyTorch's asynchronous TP is torchtitan's, not Megatron-LM's: the export refuses a plan priced with it."""
    plan = estimate_for(EstimateRequest.model_validate(estimate_request(
        {"tp": 4, "pp": 2}, cluster={"num_nodes": 2, "gpus_per_node": 8, "gpu": "H100-SXM"}, model="llama3-8b",
        training={"global_batch_size": 64, "seq_length": 8192, "tp_comm_overlap": "async_tp"})))
    with pytest.raises(ExportError, match="asynchronous TP"):
        megatron.megatron_args(plan)
