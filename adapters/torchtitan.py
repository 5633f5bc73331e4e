"""A uniform plan as torchtitan 0.3 command-line overrides, and the `torchrun` line that trains it.

torchtitan 0.3 is configured by a Python config function (`--module llama3
--config llama3_8b` picks `torchtitan.models.llama3.config_registry.llama3_8b`)
whose fields the command line overrides, `--section.field value`. `render`
gives the overrides, one per line, each a shell-quoted option and its
values, so `$(cat plan.args)` or `xargs` splits them into arguments:

    torchrun ... -m torchtitan.train --module llama3 --config llama3_8b $(cat plan.args)

The last line is always `activation_checkpoint:<mode>`: tyro reads the
activation-checkpointing policy as a subcommand, and every option after it
as an option of that policy, so add your own overrides before it.

What maps to what (torchtitan 0.3.0, PyTorch 2.13):

    plan                               torchtitan
    tp / pp                            --parallelism.tensor_parallel_degree / pipeline_parallel_degree
    dp, zero_stage 0                   --parallelism.data_parallel_replicate_degree dp, _shard_degree 1
    dp, zero_stage 1                   --parallelism.data_parallel_shard_degree dp, _replicate_degree 1,
                                       --parallelism.fsdp_reshard_after_forward never
    dp, zero_stage 2 (pp = 1)          the same as zero_stage 1 (FSDP2 has no gradient-only sharding)
    dp, zero_stage 3 (pp = 1)          --parallelism.data_parallel_shard_degree dp,
                                       --parallelism.fsdp_reshard_after_forward always (FULL_SHARD)
    dp_shard s < dp (hybrid, ZeRO>=1)  --parallelism.data_parallel_shard_degree s, _replicate_degree dp / s
                                       (HSDP: FSDP2 over torchtitan's (dp_replicate, dp_shard) mesh, whose
                                       shard groups are s consecutive replicas, the plan's)
    micro_batch_size                   --parallelism.pipeline_parallel_microbatch_size
    num_microbatches m (pp > 1)        --training.local_batch_size m * mbs (torchtitan cuts it into m)
    num_microbatches m (pp = 1)        --training.local_batch_size mbs; global / (mbs * dp) = m
                                       gradient-accumulation steps
    global_batch_size, seq_length      --training.global_batch_size, --training.seq_len
    schedule gpipe/1f1b/interleaved    --parallelism.pipeline_parallel_schedule GPipe/1F1B/Interleaved1F1B
    schedule looped-bfs                --parallelism.pipeline_parallel_schedule LoopedBFS
    schedule zb-h1/zb-h2/optimized     --parallelism.pipeline_parallel_schedule_csv resiplan-schedule.csv
                                       (the torch-csv export, run by _PipelineScheduleRuntime) with
                                       pipeline_parallel_schedule PipelineScheduleSingle (v = 1) or
                                       PipelineScheduleMulti (v > 1), as torchtitan documents
    even layer split                   --parallelism.pipeline_parallel_layers_per_stage L with
                                       first/last_stage_less_layers 0 (torchtitan then cuts exactly L)
    any other split                    --parallelism.module_fqns_per_model_part, one comma-separated
                                       FQN list per model part (virtual stage), in virtual-stage order
    recompute none/selective/full      activation_checkpoint:none / selective / full
    precision bf16                     --training.mixed_precision_param bfloat16, --training.dtype float32
    grad_precision fp32                --training.mixed_precision_reduce float32 (FSDP2's reduce dtype; the only
                                       one torchtitan 0.3 accepts, so bf16 gradients are refused)
    precision fp8                      the same, with the model's Linear layers swapped by torchtitan's
                                       float8 converter (in the config function: torchtitan 0.3 sets
                                       converters in Python, not on the command line; see
                                       adapters.torchtitan_model.model_spec(..., float8=True))
    sequence parallel (with tp > 1)    --parallelism.enable_sequence_parallel
    tp_comm_overlap async_tp (tp > 1)  --compile.enable --compile.enable_async_tensor_parallel (torchtitan's
                                       CompileConfig refuses async TP without torch.compile of the model,
                                       whose own speed-up the plan does not price)
    ep (tp 1, zero_stage >= 1)         --parallelism.expert_parallel_degree ep: torchtitan's EP groups are
                                       ep consecutive FSDP ranks, the same stage of ep consecutive replicas
                                       as the plan's; the experts' FSDP group (efsdp) the dp / ep replicas
                                       holding the same experts, or with hybrid sharding the s / ep of them
                                       in the shard group, replicated across the groups; and
                                       --training.disable_cuda_graphs (torchtitan refuses CUDA graphs with
                                       its CPU-synchronizing token dispatchers), as with pp > 1

Schedules: what PyTorch's GPipe, 1F1B and Interleaved1F1B run is the
plan's own order, action for action (tests/adapters/test_torchtitan.py
checks it against the torch-csv export); the others run from that export.

Ranks: torchtitan's device mesh is (pp, dp_replicate, dp_shard, cp, tp), tp
fastest, which is the rank order `stock_layout` gives (tp, then cp, dp, pp).

Context parallelism: --parallelism.context_parallel_degree cp. torchtitan
always runs FSDP over dp_shard x cp when cp > 1 (`ParallelDims.fsdp_enabled`),
so a cp > 1 plan of ZeRO stage 0 or 1 gets reshard_after_forward never as
ZeRO-1 does below: the weights are whole through every microbatch and the
gradients reduce-scattered over the replicas' CP ranks, as the plan prices
them (ZeRO-1 over dp x cp); at stage 0 its memory is then below the plan's.
`launch_command` starts ranks so that rank r runs on `rank_devices[r]`.

Where torchtitan is not what the plan assumed:

- ZeRO-1. torchtitan shards data-parallel state only with FSDP2 (params,
  grads and optimizer states; ZeRO-3-like) or replicates all of it. A
  zero_stage 1 plan gets FSDP over all dp ranks with reshard_after_forward
  never: parameters are gathered once per step and stay whole through
  forward and backward, gradients are reduce-scattered, optimizer states
  stay sharded. Peak memory is at most the plan's (parameters are also
  sharded between steps) and the traffic is ZeRO-1's (one reduce-scatter
  plus one all-gather of the parameters per step).
- ZeRO-2. FSDP2 shards gradients only together with the parameters; with
  reshard_after_forward never, a zero_stage 2 plan's parameters are whole
  from each microbatch's forward to its backward and its gradients are
  reduce-scattered after every backward, as planned, but the parameters
  are gathered again every microbatch (the plan gathers them once a step).
- ZeRO-2/3 with PP. torchtitan's pipeline runtime syncs gradients once a
  step, keeping them whole meanwhile: more memory than a zero_stage 2 or 3
  plan counts, so such plans are refused (plan them with pp 1, or zero_stage 1).
- Gradient accumulation without PP. torchtitan syncs (reduce-scatters or
  all-reduces) gradients after every accumulation step, so with pp = 1 and
  m > 1 microbatches it moves m times the data-parallel traffic the plan
  counted once (with hybrid sharding, the all-reduce across shard groups
  too). With pp > 1 the pipeline runtime syncs once per step.
- Selective recompute. torchtitan's selective policy is per operator: it
  saves matmul, attention and collective outputs but recomputes every second
  matmul, which is more recomputation (and less memory) than Megatron-style
  selective recompute the planner models.
- One schedule for all pipelines. torchtitan gives every pipeline the same
  CSV; a plan whose replicas have different timelines gets the slowest
  replica's order (or `replica_id`'s) everywhere. Same p, v and m, so it is
  valid for all; only the slowest replica's is tuned for it.
- Model. torchtitan builds the model from its config function: the
  command line cannot change its shape. Its llama3_8b and llama3_70b
  (Llama 3.1, bf16), qwen3_32b, qwen3_30b_a3b, gpt_oss_20b and gpt_oss_120b are
  chosen when they are the plan's architecture field for field (presets
  llama3.1-8b, llama3.1-70b, qwen3-32b, qwen3-30b-a3b, gpt-oss-20b,
  gpt-oss-120b; its 405B one trains in float8; its deepseek_v3_671b
  normalizes with epsilon 1e-5 where DeepSeek-V3 has 1e-6). For any other model, `launch_command` leaves `--module` and
  `--config` to $TORCHTITAN_MODULE and $TORCHTITAN_CONFIG, a config_registry
  function of yours, whose model_spec `adapters.torchtitan_model.model_spec`
  builds from the plan's architecture (torchtitan's Llama3, Qwen3, GPT-OSS or DeepSeek-V3; for what
  neither builds, such as LayerNorm, learned positions or Mixtral, the launch
  comments say so). Tied embeddings under PP are refused (torchtitan's Decoder
  refuses them).
- Settings the plan cannot know (tokenizer files, dataset, steps, learning
  rate): `launch_command` passes them as `"${HF_ASSETS_PATH:?...}"` and the
  like (REQUIRED), overriding the config function's own, so the command
  stops, naming the variable, until each is set.
- fp16. torchtitan 0.3 trains in bfloat16 or float32 only: fp16 plans are
  refused.
- Expert parallelism. torchtitan never splits an expert over TP (with tp > 1
  its EP groups take TP ranks), builds EP groups from FSDP ranks only, and
  leaves grouped experts in bf16 under its float8 converter: EP with tp > 1,
  EP with zero_stage 0 and a mixture of experts in fp8 are refused.
"""

from __future__ import annotations

import dataclasses
import shlex

from adapters import torch_csv
from adapters.megatron_model import RECORDED_DETAILS
from adapters.registry import ExportError
from adapters.shell_text import Required, inert, required_lines
from adapters.stock import StockLayout, check_replica, launch_blocks, stock_layout
from adapters.torchtitan_model import STANDARD, comm_backend, unsupported
from cost_models.model_spec import model_preset
from wire.schemas import ModelArchitecture, Plan

TARGET = "torchtitan"
ENTRY_MODULE = "torchtitan.train"
SCHEDULE_CSV = "resiplan-schedule.csv"
MASTER_PORT = 29500

NAMED_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B", "looped-bfs": "LoopedBFS"}
CHUNKED_SCHEDULES = frozenset({"interleaved", "looped-bfs"})  # v model chunks per stage, looped placement
CSV_SCHEDULES = frozenset({"zb-h1", "zb-h2", "optimized"})
AC_MODES = {"none": "none", "selective": "selective", "full": "full"}
# torchtitan 0.3's own bf16 config functions, and the resiplan preset each builds, field for field
# (Llama 3.1: RoPE base 500000 with Llama 3.1 scaling, RMSNorm 1e-5, no biases, untied).
# Not llama3_405b: it trains in float8 (torchao) with torch.compile, which the plan did not assume.
BUILTIN_CONFIGS = {
    ("llama3", "llama3_8b"): "llama3.1-8b",
    ("llama3", "llama3_70b"): "llama3.1-70b",
    ("qwen3", "qwen3_32b"): "qwen3-32b",
    ("qwen3", "qwen3_30b_a3b"): "qwen3-30b-a3b",
    ("gpt_oss", "gpt_oss_20b"): "gpt-oss-20b",
    ("gpt_oss", "gpt_oss_120b"): "gpt-oss-120b",
}
# What torchtitan cannot start without and the plan cannot know; before the activation-checkpoint
# subcommand, which takes every option after it as its own.
REQUIRED = (
    Required("--hf_assets_path", "HF_ASSETS_PATH", "the directory holding the tokenizer files of the model"),
    Required("--dataloader.dataset", "DATASET", "a dataset name torchtitan knows, e.g. c4"),
    Required("--training.steps", "TRAIN_STEPS", "the number of steps to train"),
    Required("--optimizer.param_groups.0.optimizer_kwargs.lr", "LR", "the peak learning rate"),
)
EMBEDDING_FQN = "tok_embeddings"
OUTPUT_FQNS = ("norm", "lm_head")


def render(plan: Plan, replica_id: int | None = None) -> str:
    """The overrides, one per line. `replica_id` only picks whose schedule a CSV schedule would follow."""
    check_replica(plan, replica_id)
    return "\n".join(torchtitan_overrides(plan)) + "\n"


def torchtitan_overrides(plan: Plan, schedule_csv_path: str = SCHEDULE_CSV) -> list[str]:
    """One shell-quoted `--section.field value...` per entry; the activation-checkpoint subcommand last.

    `shlex.split(" ".join(overrides))` is the argument list torchtitan's ConfigManager takes
    (after `--module M --config C`). ExportError when torchtitan cannot run the plan.
    """
    layout = _layout(plan)
    dp_replicate, dp_shard = layout.shard_groups, layout.shard_replicas
    microbatch = layout.micro_batch_size
    local_batch = microbatch * layout.num_microbatches if layout.pp > 1 else microbatch
    options: list[tuple[str, ...]] = [
        ("--parallelism.tensor_parallel_degree", str(layout.tp)),
        ("--parallelism.pipeline_parallel_degree", str(layout.pp)),
        ("--parallelism.data_parallel_replicate_degree", str(dp_replicate)),
        ("--parallelism.data_parallel_shard_degree", str(dp_shard)),
        ("--parallelism.context_parallel_degree", str(layout.cp)),
        ("--parallelism.expert_parallel_degree", str(layout.ep)),
        ("--parallelism.enable_sequence_parallel",),
    ]
    if layout.zero_stage >= 1 or layout.cp > 1:
        options.append(("--parallelism.fsdp_reshard_after_forward", "always" if layout.zero_stage == 3 else "never"))
    options.append(("--parallelism.pipeline_parallel_microbatch_size", str(microbatch)))
    if layout.pp > 1:
        options += _pipeline_options(plan, layout, schedule_csv_path)
    options += [
        ("--training.local_batch_size", str(local_batch)),
        ("--training.global_batch_size", str(layout.global_batch_size)),
        ("--training.seq_len", str(layout.seq_length)),
        ("--training.dtype", "float32"),
        ("--training.mixed_precision_param", "bfloat16"),
        ("--training.mixed_precision_reduce", "float32"),
    ]
    if layout.tp_comm_overlap == "async_tp" and layout.tp > 1:
        options += [("--compile.enable",), ("--compile.enable_async_tensor_parallel",)]
    if layout.pp > 1 or layout.ep > 1:
        # torchtitan refuses CUDA graphs with pipeline parallelism, and with expert parallelism over a token
        # dispatcher that synchronizes with the CPU (the all-to-all and DeepEP ones the export picks), unless they
        # are turned off (torchtitan/trainer.py, Trainer.Config validation)
        options.append(("--training.disable_cuda_graphs",))
    lines = [" ".join(shlex.quote(word) for word in option) for option in options]
    lines.append(f"activation_checkpoint:{AC_MODES[layout.recompute]}")
    return lines


def override_argv(plan: Plan, schedule_csv_path: str = SCHEDULE_CSV) -> list[str]:
    """The overrides as an argument list."""
    return shlex.split(" ".join(torchtitan_overrides(plan, schedule_csv_path)))


def model_selection(plan: Plan) -> tuple[str, str] | None:
    """torchtitan's own (--module, --config) building exactly the plan's model, or None when it has none."""
    if plan.architecture is None or not RECORDED_DETAILS <= plan.architecture.model_fields_set:
        return None  # a plan stored before it recorded RoPE and norms: torchtitan's model may not be it
    if plan.precision == "fp8":
        return None  # its llama3_8b and llama3_70b train in bf16
    if plan.moe_dispatcher == "flex":
        return None  # its configs exchange tokens all-to-all ("standard")
    planned = _architecture_fields(plan.architecture)
    for selection, preset in BUILTIN_CONFIGS.items():
        if planned == _architecture_fields(resolve_architecture(preset)):
            return selection
    return None


def resolve_architecture(preset: str) -> ModelArchitecture:
    """The wire architecture of a resiplan preset."""
    return ModelArchitecture.model_validate(dataclasses.asdict(model_preset(preset)))


def _architecture_fields(arch: ModelArchitecture) -> dict:
    fields = arch.model_dump(exclude={"name"})
    fields["num_kv_heads"] = arch.num_kv_heads or arch.num_attention_heads
    return fields


def schedule_csv(plan: Plan, replica_id: int | None = None) -> str | None:
    """The torch-csv text torchtitan must read from SCHEDULE_CSV, or None when a named schedule runs the plan."""
    layout = _layout(plan)
    if layout.pp == 1 or layout.schedule not in CSV_SCHEDULES:
        return None
    check_replica(plan, replica_id)
    return torch_csv.render(plan, replica_id)


def module_fqns_per_model_part(layout: StockLayout) -> list[list[str]]:
    """The modules of each of the pp * v model parts, in virtual-stage order (chunk c of stage s is part c*p+s)."""
    parts: list[list[str]] = []
    first = 0
    for count in layout.chunk_layers(TARGET):
        parts.append([f"layers.{i}" for i in range(first, first + count)])
        first += count
    parts[0].insert(0, EMBEDDING_FQN)
    parts[-1].extend(OUTPUT_FQNS)
    return parts


def launch_command(plan: Plan) -> str:
    """Shell lines that start torchtitan on the plan's devices, rank r on `rank_devices[r]`.

    torchrun's static rendezvous (--master_addr, --node_rank) numbers ranks node by node:
    node rank k gets the ranks after those of node ranks 0..k-1, local rank i the i-th of
    them, and local rank i uses the i-th visible GPU. CUDA_VISIBLE_DEVICES lists a node's
    GPUs in rank order where they are not simply 0..nproc-1. One line serves every node
    when all run the same GPUs; otherwise there is a line per node. Zero-bubble and
    optimized plans first write their schedule CSV (a here-document) where torchtitan
    reads it.
    """
    layout = _layout(plan)
    args = override_argv(plan)
    selection = model_selection(plan)
    if selection is None:
        name = inert(plan.architecture.name)
        model_text = (f'--module "${{TORCHTITAN_MODULE:?a torchtitan module whose config_registry describes {name}}}" '
                      '--config "${TORCHTITAN_CONFIG:?its config function}"')
    else:
        model_text = f"--module {shlex.quote(selection[0])} --config {shlex.quote(selection[1])}"
    # the required settings go before the activation-checkpoint subcommand, the last word
    options = [*(shlex.quote(word) for word in args[:-1]), *(setting.words() for setting in REQUIRED),
               shlex.quote(args[-1])]
    train = f"-m {ENTRY_MODULE} {model_text} {' '.join(options)}"

    nodes = launch_blocks(layout, f"{TARGET} via torchrun")
    header = (f"# resiplan plan {inert(plan.plan_id)}: {TARGET} on {layout.world_size} GPUs "
              f"(tp {layout.tp}, pp {layout.pp}, dp {layout.dp}) on {len(nodes)} node(s)")
    lines = [header, *_model_lines(plan, selection), *required_lines(REQUIRED)]
    csv_text = schedule_csv(plan)
    if csv_text is not None:
        lines.append(f"# the plan's {layout.schedule} schedule, read by --parallelism.pipeline_parallel_schedule_csv")
        lines.append(f"cat > {SCHEDULE_CSV} <<'RESIPLAN_CSV'")
        lines.extend(csv_text.rstrip("\n").split("\n"))
        lines.append("RESIPLAN_CSV")
    if len(nodes) == 1:
        node, gpus = nodes[0]
        lines.append(f"# on node {node}")
        lines.append(f"{_visible(gpus)}torchrun --standalone --nnodes=1 --nproc_per_node={len(gpus)} {train}")
        return "\n".join(lines) + "\n"
    rendezvous = (f"--nnodes={len(nodes)} --master_addr=\"${{MASTER_ADDR:?address of node {nodes[0][0]}}}\" "
                  f"--master_port={MASTER_PORT}")
    if len({tuple(gpus) for _, gpus in nodes}) == 1:
        gpus = nodes[0][1]
        mapping = ", ".join(f"{rank} on node {node}" for rank, (node, _) in enumerate(nodes))
        lines.append(f"# on every node, NODE_RANK {mapping}")
        lines.append(f"{_visible(gpus)}torchrun {rendezvous} --nproc_per_node={len(gpus)} "
                     f"--node_rank=\"${{NODE_RANK:?0..{len(nodes) - 1}}}\" {train}")
        return "\n".join(lines) + "\n"
    # torchrun gives node_rank k the ranks after those of node ranks 0..k-1, however many each runs
    for rank, (node, gpus) in enumerate(nodes):
        lines.append(f"# on node {node}")
        lines.append(f"{_visible(gpus)}torchrun {rendezvous} --nproc_per_node={len(gpus)} --node_rank={rank} {train}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------


def _layout(plan: Plan) -> StockLayout:
    layout = stock_layout(plan, TARGET)
    problems = []
    if layout.precision not in ("bf16", "fp8"):
        problems.append(f'torchtitan 0.3 trains in bfloat16 or float32, not {layout.precision} (ask with '
                        '"training": {"precision": "bf16"}, or "fp8" for its float8 linears)')
    if layout.grad_precision == "bf16":
        problems.append('bf16 gradients: torchtitan 0.3 reduces gradients in float32 only (its '
                        'training.mixed_precision_reduce accepts nothing else), twice the traffic and gradient memory '
                        'the plan priced; plan with "training": {"grad_precision": "fp32"}')
    expected = layout.dp * layout.num_microbatches * layout.micro_batch_size
    if layout.global_batch_size != expected:
        problems.append(f"global_batch_size {layout.global_batch_size} is not dp {layout.dp} x "
                        f"{layout.num_microbatches} microbatches x micro_batch_size {layout.micro_batch_size}")
    if layout.cp > 1 and layout.seq_length % (2 * layout.cp * layout.tp):
        problems.append(f"seq_length {layout.seq_length} is not divisible by tp {layout.tp} x 2 x cp {layout.cp}, "
                        "which torchtitan's context parallelism needs")
    elif layout.sequence_parallel and layout.seq_length % layout.tp:
        problems.append(f"seq_length {layout.seq_length} is not divisible by tp {layout.tp}, which torchtitan's "
                        "sequence parallelism needs")
    if layout.pp > 1 and layout.architecture.tied_embeddings:
        problems.append("torchtitan 0.3 does not tie embeddings under pipeline parallelism (its Decoder refuses "
                        "weight tying with pp > 1); estimate a pp 1 layout (POST /v1/estimate) or untie them")
    if layout.recompute not in AC_MODES:
        problems.append(f"unknown recompute mode {layout.recompute!r}")
    if layout.pp == 1 and layout.virtual_stages > 1:
        problems.append(f"virtual_stages {layout.virtual_stages} without pipeline parallelism")
    if layout.zero_stage >= 2 and layout.pp > 1:
        problems.append(f"zero_stage {layout.zero_stage} with pp {layout.pp}: torchtitan's pipeline runtime keeps "
                        "gradients whole until the step's last microbatch, more memory than the plan counts (plan "
                        "with pp 1, or zero_stage 1)")
    if layout.tp_comm_overlap == "megatron":
        problems.append("TP collectives priced under Megatron's --tp-comm-overlap (training.tp_comm_overlap "
                        'megatron), which torchtitan does not run: plan with tp_comm_overlap "async_tp" (its '
                        'asynchronous TP) or "none", or export to Megatron-LM')
    problems += _expert_problems(layout)
    if problems:
        raise ExportError(f"{TARGET} cannot run this plan: {'; '.join(problems)}")
    return layout


def _expert_problems(layout: StockLayout) -> list[str]:
    """Where torchtitan's expert parallelism is not the plan's: it takes its EP ranks from the FSDP (and
    TP) ranks, ep consecutive ranks TP fastest, and never splits an expert over TP (the plan's expert-TP 1,
    whose EP groups are those ranks), and its float8 converter leaves grouped experts in bf16."""
    problems = []
    if layout.architecture.num_experts and layout.precision == "fp8":
        problems.append("fp8 with a mixture of experts (torchtitan's float8 converter leaves its grouped experts in "
                        "bf16, which the plan did not price); plan it in bf16")
    if layout.ep == 1:
        return problems
    if layout.moe_a2a_overlap:
        problems.append("the all-to-alls priced under Megatron's batch-level EP overlap (training.moe_a2a_overlap), "
                        "which torchtitan does not run; plan without it, or export to Megatron-LM")
    if layout.tp > 1 and layout.etp != 1:
        problems.append(f"ep {layout.ep} with tp {layout.tp}: torchtitan never splits an expert over TP (its EP "
                        "takes TP ranks instead), the plan splits each over its TP group as Megatron-LM does; "
                        "estimate the layout with etp 1 (POST /v1/estimate) or export to Megatron-LM")
    if layout.zero_stage == 0:
        problems.append(f"ep {layout.ep} with zero_stage 0: torchtitan forms EP groups from its FSDP ranks "
                        "(data_parallel_shard_degree), which zero_stage 0 replicates; plan with zero_stage 1")
    return problems


def _pipeline_options(plan: Plan, layout: StockLayout, schedule_csv_path: str) -> list[tuple[str, ...]]:
    v = layout.virtual_stages
    options: list[tuple[str, ...]] = []
    if layout.schedule in CSV_SCHEDULES:
        options.append(("--parallelism.pipeline_parallel_schedule",
                        "PipelineScheduleSingle" if v == 1 else "PipelineScheduleMulti"))
        options.append(("--parallelism.pipeline_parallel_schedule_csv", schedule_csv_path))
    elif layout.schedule in NAMED_SCHEDULES:
        if (layout.schedule in CHUNKED_SCHEDULES) != (v > 1):
            raise ExportError(f"{TARGET} cannot run this plan: schedule {layout.schedule} with virtual_stages {v}")
        options.append(("--parallelism.pipeline_parallel_schedule", NAMED_SCHEDULES[layout.schedule]))
    else:
        raise ExportError(f"{TARGET} cannot run this plan: unknown schedule {layout.schedule!r}")
    parts = module_fqns_per_model_part(layout)
    sizes = {sum(1 for fqn in part if fqn.startswith("layers.")) for part in parts}
    if len(sizes) == 1:
        # torchtitan cuts num_layers + first_less + last_less "effective layers" into ceil(.../L) parts
        options += [
            ("--parallelism.pipeline_parallel_layers_per_stage", str(sizes.pop())),
            ("--parallelism.pipeline_parallel_first_stage_less_layers", "0"),
            ("--parallelism.pipeline_parallel_last_stage_less_layers", "0"),
        ]
    else:
        options.append(("--parallelism.module_fqns_per_model_part", *(",".join(part) for part in parts)))
    return options


def _model_lines(plan: Plan, selection: tuple[str, str] | None) -> list[str]:
    """Comments saying which model torchtitan builds, or what the user's config function must build."""
    arch = plan.architecture
    if selection is not None:
        return [f"# model: torchtitan's own {selection[1]}, which is this plan's architecture field for field"]
    problems = unsupported(arch)
    float8 = plan.precision == "fp8"
    backend = comm_backend(plan.moe_dispatcher)
    arguments = "plan.architecture" + (", float8=True" if float8 else "") + (
        f', moe_comm_backend="{backend}"' if backend != STANDARD else "")
    if problems:
        return ["# model: torchtitan has no config function for it, and its decoders cannot build it",
                f"#   ({inert('; '.join(problems))}): TORCHTITAN_MODULE must name a module of yours that does"
                + (" (with float8 linears: the plan trains in fp8)" if float8 else "")]
    if float8 or backend != STANDARD:
        why = " and ".join(([] if not float8 else ["trains in fp8"]) + (
            [] if backend == STANDARD else ["sends its experts' tokens with DeepEP (the flex dispatcher)"]))
        return [f"# model: the plan {why}, which torchtitan sets in Python; TORCHTITAN_MODULE/TORCHTITAN_CONFIG",
                "#   name your config function, whose model_spec is",
                f"#   adapters.torchtitan_model.model_spec({arguments})"]
    return ["# model: torchtitan has no config function for it; TORCHTITAN_MODULE/TORCHTITAN_CONFIG name yours,",
            f"#   whose model_spec is adapters.torchtitan_model.model_spec({arguments})"]


def _visible(gpus: list[int]) -> str:
    if gpus == list(range(len(gpus))):
        return ""
    return f"CUDA_VISIBLE_DEVICES={','.join(map(str, gpus))} "
