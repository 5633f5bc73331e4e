"""A uniform plan as Megatron-LM `pretrain_gpt.py` arguments, and the torchrun line that starts it.

`megatron_args(plan)` is the argument list; `render` writes it as a bash
array (`MEGATRON_ARGS=( ... )`, one flag and its value a line, shell-quoted)
under comments with the world size and the rank order; `launch_command`
writes the `torchrun ... pretrain_gpt.py ...` command for every node.

What the plan sets, and how:

    tp, pp                   --tensor-model-parallel-size, --pipeline-model-parallel-size
                             (dp is not an argument: Megatron takes world size / (tp * pp))
    v > 1 (interleaved)      --num-virtual-stages-per-pipeline-rank v (not
                             --num-layers-per-virtual-pipeline-stage, which Megatron-LM
                             refuses together with an uneven first/last stage)
    m not a multiple of pp   --microbatch-group-size-per-virtual-pipeline-stage g when the
                             plan's interleaved groups all have size g (Megatron's default
                             group is pp and needs m % pp == 0)
    layer split              even: nothing; only the first and/or last stage differ:
                             --decoder-first/last-pipeline-num-layers; otherwise, and
                             for uneven model chunks (an estimate's layers_per_chunk),
                             --pipeline-model-parallel-layout, e.g. "Et*3|t*5|t*5|t*3L"
                             (one `|`-separated entry per virtual stage c*pp + s, `E`
                             embedding, `t` a transformer layer, `L` the loss)
    rank placement           Megatron's default order is tp fastest, then dp, then pp; when
                             that would spread a node's ranks over non-contiguous global
                             ranks (a replica kept on one node, its stages across
                             pipeline ranks), --use-tp-pp-dp-mapping orders tp, pp, dp
    tp > 1                   --sequence-parallel; tp_comm_overlap megatron: --tp-comm-overlap
                             (validate_args asserts sequence parallelism with it, so only
                             with tp > 1, where it prices)
    experts (mixture)        --num-experts, --moe-router-topk, --moe-ffn-hidden-size,
                             --moe-shared-expert-intermediate-size; ep: --expert-model-parallel-size,
                             etp: --expert-tensor-parallel-size (default rank order only);
                             --moe-token-dispatcher-type alltoall, or flex --moe-flex-dispatcher-backend
                             deepep (training.moe_dispatcher); dense first layers: --moe-layer-freq;
                             moe_a2a_overlap: --overlap-moe-expert-parallel-comm and
                             CUDA_DEVICE_MAX_CONNECTIONS=8
    recompute                selective: --recompute-granularity selective (core attention);
                             full: --recompute-granularity full --recompute-method uniform
                             --recompute-num-layers 1
    zero_stage 1             --use-distributed-optimizer --overlap-param-gather; always
                             --overlap-grad-reduce
    zero_stage 2 / 3         Megatron-FSDP: --use-megatron-fsdp --data-parallel-sharding-strategy
                             optim_grads / optim_grads_params (megatron_fsdp.ShardingStrategy 2 / 3)
                             --ckpt-format fsdp_dtensor (validate_args requires it), with
                             --use-distributed-optimizer (Megatron-FSDP v1 runs under it) and
                             both overlaps
    dp_shard s < dp (hybrid)     --num-distributed-optimizer-instances dp / s (megatron-core's partial
                                 distributed optimizer: dp / s instances of s consecutive replicas); with
                                 Megatron-FSDP also --outer-dp-sharding-strategy no_shard (HSDP)
    grad_precision bf16      --grad-reduce-in-bf16 (fp32, the default, sets nothing)
    precision                --bf16 / --fp16; fp8: --bf16 with Transformer Engine's FP8
                             (--fp8-format hybrid --fp8-recipe delayed
                             --fp8-amax-history-len 1024 --fp8-amax-compute-algo max, the
                             settings of NVIDIA's published FP8 recipes)
    architecture             adapters.megatron_model: shape, GQA, --swiglu, untied embeddings,
                             --normalization and --norm-epsilon, RoPE (--position-embedding-type
                             rope, --rotary-base, Llama 3.1 --use-rope-scaling) or a learned
                             table, --disable-bias-linear / --add-qkv-bias
    batch                    --seq-length, --max-position-embeddings (the sequence length with
                             RoPE, the table with learned positions), --micro-batch-size,
                             --global-batch-size

Not set: data, tokenizer (the vocabulary comes from it), learning rate and
its schedule, iterations, checkpointing. `launch_command` passes the ones
pretrain_gpt.py cannot start without as `--data-path "${DATA_PATH:?...}"`
and the like (REQUIRED), so the printed command stops, naming the variable,
until each is set; the rendered header lists them.

Plan-supplied text (plan_id, the model's name, device ids) reaches comments
only through `adapters.shell_text.inert`; every argument is shlex-quoted.

Refused (ExportError): what `stock_layout` refuses (replicas that differ in
stage count, TP, layer split or microbatches; TP that differs between
stages), schedules Megatron-LM does not run (zb-h1, zb-h2, optimized; a
gpipe plan runs as Megatron's 1F1B, the same bubble with less activation
memory), interleaved microbatch groups Megatron cannot reproduce, a
placement no torchrun launch reaches (some node's ranks non-contiguous in
both rank orders), and TP collectives priced under PyTorch's asynchronous TP
(tp_comm_overlap async_tp).

Validation: tests/adapters/test_megatron.py feeds these arguments to
megatron-core 0.16 on CPU: `parallel_state.initialize_model_parallel` under
torch's fake process group (group sizes and each checked rank's TP/PP/DP
group devices), `TransformerConfig.__post_init__`, the layer offsets and
counts megatron-core builds per pipeline rank and virtual stage, its
microbatch calculator and its interleaved schedule table;
tests/adapters/test_model_exports.py builds the GPTModel the flags describe
and compares its parameter count with the plan's. Megatron-LM's own
training code (megatron/training/arguments.py's parser, `validate_args`,
`core_transformer_config_from_args`, and gpt_builders.py) is not part of
the megatron-core wheel and is on no package index, so those tests
re-implement it: the parser definitions of the emitted flags, copied from
Megatron-LM core_v0.16.1 (the tag megatron-core 0.16.1 comes from), the
`validate_args` rules that concern them, the config's field-by-field copy
and gpt_builder's GPTModel call. tests/adapters/megatron_lm_checkout_check.py
runs the real ones instead when RESIPLAN_MEGATRON_LM names a checkout of
that tag.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from adapters.megatron_model import megatron_lm_model_args
from adapters.registry import ExportError
from adapters.shell_text import Required, inert, required_lines
from adapters.stock import StockLayout, check_replica, node_blocks, stock_layout
from cost_models.device import DeviceSpec
from cost_models.pipeline import interleaved_group_sizes
from wire.schemas import Plan

TARGET = "Megatron-LM"
SCHEDULES = frozenset({"gpipe", "1f1b", "interleaved"})
DEFAULT_ORDER = "tp-dp-pp"  # Megatron's default rank order: tp fastest, then dp, then pp
TP_PP_DP_ORDER = "tp-pp-dp"  # with --use-tp-pp-dp-mapping
ENTRY_SCRIPT = "pretrain_gpt.py"
MASTER_PORT = 29500
# Megatron-FSDP's names for ZeRO stages 2 and 3 (megatron_fsdp.fully_shard.ShardingStrategy).
FSDP_SHARDING = {2: "optim_grads", 3: "optim_grads_params"}
# What pretrain_gpt.py cannot start without and the plan cannot know: the launch command reads each
# from the environment and stops, saying which, while one is unset.
REQUIRED = (
    Required("--data-path", "DATA_PATH", "your dataset prefix (the .bin/.idx path without its extension)"),
    Required("--tokenizer-type", "TOKENIZER_TYPE", "a Megatron tokenizer type, e.g. HuggingFaceTokenizer"),
    Required("--tokenizer-model", "TOKENIZER_MODEL", "the tokenizer: a Hugging Face name or path"),
    Required("--train-iters", "TRAIN_ITERS", "the number of iterations to train"),
    Required("--lr", "LR", "the peak learning rate"),
)
# Delayed scaling from the largest amax of the last 1,024 steps: the setting of NVIDIA's reference FP8
# pretraining scripts (Megatron-LM's Llama 3 examples, NeMo's recipes); Megatron's default is 1 step.
FP8_AMAX = ("--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max")


# ---------------------------------------------------------------------------------------------------------------
# Layout



def stock(plan: Plan) -> StockLayout:
    """The plan's one shape, or ExportError saying what Megatron-LM cannot run."""
    layout = stock_layout(plan, TARGET, SCHEDULES)
    if layout.tp_comm_overlap == "async_tp":
        raise ExportError(f"{TARGET} cannot run this plan: its TP collectives are priced under PyTorch's asynchronous "
                          "TP (training.tp_comm_overlap async_tp), which Megatron-LM does not run; plan with "
                          'tp_comm_overlap "megatron" (--tp-comm-overlap) or "none", or export to torchtitan')
    return layout


def _reorder(layout: StockLayout, order: str) -> tuple[str, ...]:
    """Global rank -> device in `order`; layout.rank_devices is in the default tp-dp-pp order."""
    if order == DEFAULT_ORDER:
        return layout.rank_devices
    # A stage's tp x cp ranks stay together in both orders (tp-cp-ep-dp-pp, tp-cp-ep-pp-dp).
    group, pp, dp = layout.group_size, layout.pp, layout.dp
    return tuple(
        layout.rank_devices[(stage * dp + replica) * group + t]
        for replica in range(dp)
        for stage in range(pp)
        for t in range(group)
    )


def rank_order(layout: StockLayout) -> tuple[str, tuple[str, ...]]:
    """(order name, global rank -> device) for the rank order Megatron will be told to use. Expert
    parallelism needs the default order: only there are megatron-core's EP groups the plan's (a stage's
    ranks in consecutive replicas); with --use-tp-pp-dp-mapping they would run across pipeline stages."""
    orders = (DEFAULT_ORDER,) if layout.ep > 1 else (DEFAULT_ORDER, TP_PP_DP_ORDER)
    for order in orders:
        devices = _reorder(layout, order)
        if node_blocks(devices) is not None:
            return order, devices
    raise ExportError(
        f"{TARGET} cannot place this plan's ranks on its devices: torchrun gives each node one contiguous "
        f"block of global ranks, and in both of Megatron's rank orders (tp-dp-pp, or tp-pp-dp with "
        f"--use-tp-pp-dp-mapping) some node's ranks are not contiguous; export it with --format torch-csv "
        f"and place the ranks yourself"
    )


def rank_devices(plan: Plan) -> tuple[str, ...]:
    """Global rank -> device, in the rank order the emitted arguments select."""
    return rank_order(stock(plan))[1]


def _microbatch_group(layout: StockLayout) -> int | None:
    """--microbatch-group-size-per-virtual-pipeline-stage for the plan's interleaved groups (None: Megatron's default)."""
    if layout.virtual_stages == 1:
        return None
    p, m = layout.pp, layout.num_microbatches
    if m % p == 0:
        return None  # groups of pp, Megatron's default
    groups = interleaved_group_sizes(m, p)
    if len(set(groups)) == 1 and p <= groups[0] <= m:
        return groups[0]
    raise ExportError(
        f"{TARGET} cannot run this plan's interleaved schedule: megatron-core runs groups of one size N in "
        f"[pp={p}, m={m}] (and a last group of 0 or >= pp microbatches), this plan's {m} microbatches per "
        f"replica run in groups of {groups}; ask for a plan with \"options\": {{\"schedules\": [\"1f1b\"]}} "
        f"or a global batch that gives a multiple of {p} microbatches per replica"
    )


def _pipeline_layout(chunks: Sequence[int]) -> str:
    """Megatron's --pipeline-model-parallel-layout of the model chunks' layer counts (virtual stage c*pp + s
    holds chunks[c*pp + s]): one entry per virtual stage, E first, L last."""
    entries = []
    for virtual, count in enumerate(chunks):
        entry = f"t*{count}" if count > 1 else "t" * count
        if virtual == 0:
            entry = "E" + entry
        if virtual == len(chunks) - 1:
            entry += "L"
        entries.append(entry)
    return "|".join(entries)


def _split_args(layout: StockLayout) -> list[str]:
    """The layer split: nothing when even, first/last stage sizes when only they differ, else a full layout."""
    split, v = layout.layers_per_stage, layout.virtual_stages
    chunks = layout.chunk_layers(TARGET)
    if layout.layers_per_chunk is not None:
        return ["--pipeline-model-parallel-layout", _pipeline_layout(chunks)]  # sets the virtual stages itself
    virtual = ["--num-virtual-stages-per-pipeline-rank", str(v)] if v > 1 else []
    if len(set(split)) == 1:
        return virtual
    first, last = ["--decoder-first-pipeline-num-layers", str(split[0])], ["--decoder-last-pipeline-num-layers", str(split[-1])]
    if len(split) == 2:
        return virtual + first + last
    middle = set(split[1:-1])
    if len(middle) == 1:
        (size,) = middle
        return virtual + (first if split[0] != size else []) + (last if split[-1] != size else [])
    return ["--pipeline-model-parallel-layout", _pipeline_layout(chunks)]  # sets the virtual stages itself


# ---------------------------------------------------------------------------------------------------------------
# Arguments


def _args(layout: StockLayout, order: str) -> list[str]:
    arch = layout.architecture
    args = [
        "--tensor-model-parallel-size", str(layout.tp),
        "--pipeline-model-parallel-size", str(layout.pp),
    ]
    if layout.cp > 1:
        args += ["--context-parallel-size", str(layout.cp)]
    args += _split_args(layout)
    group = _microbatch_group(layout)
    if group is not None:
        args += ["--microbatch-group-size-per-virtual-pipeline-stage", str(group)]
    if order == TP_PP_DP_ORDER:
        args.append("--use-tp-pp-dp-mapping")
    if layout.sequence_parallel:
        args.append("--sequence-parallel")
        if layout.tp_comm_overlap == "megatron":
            args.append("--tp-comm-overlap")
    if layout.moe_a2a_overlap:  # the plan priced its all-to-alls under the batch-level EP overlap
        args.append("--overlap-moe-expert-parallel-comm")
    args += megatron_lm_model_args(arch, layout.seq_length, TARGET, layout.ep, layout.moe_dispatcher, layout.etp)
    args += [
        "--seq-length", str(layout.seq_length),
        "--micro-batch-size", str(layout.micro_batch_size),
        "--global-batch-size", str(layout.global_batch_size),
    ]
    if layout.recompute == "selective":
        args += ["--recompute-granularity", "selective"]
    elif layout.recompute == "full":
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    if layout.zero_stage >= 1:
        args.append("--use-distributed-optimizer")
    if layout.zero_stage >= 2:
        args += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", FSDP_SHARDING[layout.zero_stage],
                 "--ckpt-format", "fsdp_dtensor"]
    if layout.zero_stage >= 1 and layout.shard_groups > 1:
        # Hybrid sharding: megatron-core cuts each data-parallel group into this many consecutive instances
        # (parallel_state's intra-partial groups), the plan's shard groups; Megatron-FSDP replicates across them.
        args += ["--num-distributed-optimizer-instances", str(layout.shard_groups)]
        if layout.zero_stage >= 2:
            args += ["--outer-dp-sharding-strategy", "no_shard"]
    args.append("--overlap-grad-reduce")
    if layout.zero_stage >= 1:
        # The weight all-gather under the next forward, as priced (cost_models.iteration.exposed_param_gather_ms;
        # ZeRO-3's per-layer gathers, cost_models.sharded_dp).
        args.append("--overlap-param-gather")
    args.append("--fp16" if layout.precision == "fp16" else "--bf16")
    if layout.grad_precision == "bf16":
        args.append("--grad-reduce-in-bf16")  # the gradient buffer in bf16 too (megatron-core grad_reduce_in_fp32)
    if layout.precision == "fp8":
        args += ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", *FP8_AMAX]
    return args


def megatron_args(plan: Plan) -> list[str]:
    """The pretrain_gpt.py arguments that set up this plan's parallel layout, model shape and batch."""
    layout = stock(plan)
    order, _ = rank_order(layout)
    return _args(layout, order)


def _lines(args: Sequence[str]) -> list[str]:
    """Each flag with its values, shell-quoted."""
    lines: list[list[str]] = []
    for arg in args:
        if arg.startswith("--") or not lines:
            lines.append([arg])
        else:
            lines[-1].append(arg)
    return [" ".join(shlex.quote(part) for part in line) for line in lines]


def _ranges(blocks: list[tuple[int, list[int]]]) -> list[str]:
    lines, rank = [], 0
    for node, gpus in blocks:
        last = rank + len(gpus) - 1
        ranks = f"rank {rank}" if last == rank else f"ranks {rank}-{last}"
        lines.append(f"#   {ranks}: {' '.join(f'{node}:{gpu}' for gpu in gpus)}")
        rank = last + 1
    return lines


def _cp_text(layout: StockLayout) -> str:
    return f" x cp {layout.cp}" if layout.cp > 1 else ""


def _header(plan: Plan, layout: StockLayout, order: str, devices: tuple[str, ...]) -> list[str]:
    arch = layout.architecture
    blocks = node_blocks(devices) or []
    lines = [
        f"# {TARGET} {ENTRY_SCRIPT} arguments for resiplan plan {inert(plan.plan_id)} (model {inert(arch.name)})",
        (
            f"# world size {layout.world_size} = tp {layout.tp}{_cp_text(layout)} x pp {layout.pp} x dp {layout.dp} "
            f"(Megatron derives dp from the world size), on {len(layout.nodes)} node(s)"
        ),
        f"# pipeline: {layout.schedule}, layers per stage {list(layout.layers_per_stage)}"
        + (f", {layout.virtual_stages} model chunks per stage" if layout.virtual_stages > 1 else ""),
        (
            f"# batch: {layout.num_microbatches} microbatches of {layout.micro_batch_size} per replica, "
            f"global batch {layout.global_batch_size} of {layout.seq_length} tokens"
        ),
    ]
    if layout.schedule == "gpipe":
        lines.append("# the plan's gpipe order runs as Megatron's 1F1B: the same bubble, less activation memory")
    lines.append(
        f"# rank order {order}"
        + (" (--use-tp-pp-dp-mapping)" if order == TP_PP_DP_ORDER else " (Megatron's default)")
        + ": global rank -> device"
    )
    lines += _ranges(blocks)
    lines += [
        f"# not set here: data, tokenizer (its vocabulary must be the plan's {arch.vocab_size} entries; Megatron pads",
        "#   it to a multiple of 128 x tp), learning rate and its schedule, iterations, checkpointing",
        f'# use: torchrun ... {ENTRY_SCRIPT} "${{MEGATRON_ARGS[@]}}" {" ".join(r.flag + " ..." for r in REQUIRED)}',
        "#   (resiplan launch prints the whole command)",
    ]
    return lines


def render(plan: Plan, replica_id: int | None = None) -> str:
    """A bash fragment: comments, then MEGATRON_ARGS=( one flag a line ). Every replica runs alike."""
    layout = stock(plan)
    check_replica(plan, replica_id)
    order, devices = rank_order(layout)
    lines = _header(plan, layout, order, devices)
    lines.append("MEGATRON_ARGS=(")
    lines += [f"  {line}" for line in _lines(_args(layout, order))]
    lines.append(")")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# Launch


def _left_out_by_node(plan: Plan) -> dict[int, str]:
    """node -> " (its unused devices unused; its failed devices failed)", for the nodes that have any."""
    # ids are checked "<node>:<gpu>" (or "<node>:*") by stock_layout; inert() keeps a comment a comment regardless
    by_node: dict[int, tuple[list[str], list[str]]] = {}
    for kind, devices in ((0, plan.unused_devices), (1, plan.excluded_devices)):
        for device in devices:
            by_node.setdefault(DeviceSpec.parse(device).node, ([], []))[kind].append(inert(device))
    text = {}
    for node, (unused, failed) in by_node.items():
        parts = [f"{', '.join(devices)} {what}" for devices, what in ((unused, "unused"), (failed, "failed")) if devices]
        text[node] = f" ({'; '.join(parts)})"
    return text


def launch_command(plan: Plan) -> str:
    """The torchrun command (one per node, NODE_RANK picks the node) that runs this plan with Megatron-LM."""
    layout = stock(plan)
    order, devices = rank_order(layout)
    blocks = node_blocks(devices) or []
    counts = {len(gpus) for _, gpus in blocks}
    identity = all(gpus == list(range(layout.gpus_per_node)) for _, gpus in blocks)
    last = len(blocks) - 1
    lines = [
        (
            f"# {TARGET} launch for resiplan plan {inert(plan.plan_id)}: {layout.world_size} ranks "
            f"(tp {layout.tp}{_cp_text(layout)} x pp {layout.pp} x dp {layout.dp}) on {len(blocks)} node(s)"
        ),
        "# run it on every node with NODE_RANK set as listed and MASTER_ADDR the host of NODE_RANK 0;",
        "# a node's local rank i runs on the i-th GPU of its list (CUDA_VISIBLE_DEVICES keeps that order)",
    ]
    left_out = _left_out_by_node(plan)
    for node_rank, (node, gpus) in enumerate(blocks):
        lines.append(
            f"#   NODE_RANK={node_rank}: node {node}, {len(gpus)} ranks on GPUs "
            f"{','.join(map(str, gpus))}{left_out.get(node, '')}"
        )
    if len(counts) > 1:
        lines.append(
            "# nodes run different numbers of ranks: torchrun numbers them in NODE_RANK order; Megatron-LM must "
            "bind each rank to its LOCAL_RANK GPU (versions asserting local_rank == rank % device_count need "
            "equal counts)"
        )
    if not identity or len(counts) > 1:
        lines.append('case "$NODE_RANK" in')
        for node_rank, (node, gpus) in enumerate(blocks):
            nproc = f"NPROC_PER_NODE={len(gpus)}; " if len(counts) > 1 else ""
            lines.append(
                f"  {node_rank}) {nproc}export CUDA_VISIBLE_DEVICES={','.join(map(str, gpus))} ;;  # node {node}"
            )
        lines.append("esac")
    if layout.moe_a2a_overlap:
        # Its communication stream runs beside the computation only with several connections (megatron-core's
        # MoE README); Megatron-LM then only warns about TP and CP, which want 1.
        lines.append("export CUDA_DEVICE_MAX_CONNECTIONS=8  # the EP all-to-all overlap needs more than 1")
    elif layout.tp > 1 or layout.cp > 1:
        lines.append("export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron-LM requires it with tensor or context parallelism")
    nproc = f'"${{NPROC_PER_NODE:?NODE_RANK must be 0..{last}}}"' if len(counts) > 1 else str(counts.pop())
    command = (
        f'torchrun --nnodes {len(blocks)} --nproc-per-node {nproc} --node-rank "${{NODE_RANK:?0..{last}}}" '
        f'--master-addr "${{MASTER_ADDR:?the host of NODE_RANK 0}}" --master-port {MASTER_PORT} {ENTRY_SCRIPT}'
    )
    arg_lines = _lines(_args(layout, order)) + [setting.words() for setting in REQUIRED]
    lines += required_lines(REQUIRED)
    lines.append(" \\\n  ".join([command, *arg_lines]))
    return "\n".join(lines) + "\n"
