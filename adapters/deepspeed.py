"""A uniform plan as a DeepSpeed config (ds_config.json), plus the PipelineModule settings it cannot hold.

`render` gives one JSON document: a DeepSpeed config that `deepspeed.initialize(config=...)`
or `--deepspeed_config ds_config.json` takes as it is, with one extra top-level key,
`"resiplan"`, that DeepSpeed ignores (it reads only the keys it knows). That key holds
what goes into the training script instead: the `PipelineModule` arguments (stages,
topology, layer split), the tensor-parallel size, and the plan's rank-to-GPU map.

    with open("ds_config.json") as f:
        ds_config = json.load(f)
    pm = ds_config["resiplan"]["pipeline_module"]
    topology = PipeModelDataParallelTopology(**{k: pm["topology"][k] for k in ("num_pp", "num_mp", "num_dp")})
    if pm["partition_method"] == "explicit":       # an uneven split: see planned_pipeline_module
        parts = pipeline_parts(pm["transformer_layer_boundaries"], first_transformer_index=1, num_layers=len(layers))
        model = planned_pipeline_module(layers, parts, topology=topology, loss_fn=...)
    else:
        model = PipelineModule(layers, topology=topology, partition_method=pm["partition_method"], loss_fn=...)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=...)

What maps to what (DeepSpeed 0.19.8):

    plan                               DeepSpeed
    global_batch_size                  train_batch_size (= micro x accumulation x dp, which DeepSpeedConfig asserts)
    micro_batch_size                   train_micro_batch_size_per_gpu
    num_microbatches m                 gradient_accumulation_steps (the PipelineEngine runs m microbatches a step)
    zero_stage 0 / 1                   zero_optimization.stage 0 / 1
    zero_stage 2 / 3 (pp = 1 only)     zero_optimization.stage 2 / 3, and no PipelineModule: the PipelineEngine
                                       refuses ZeRO-2/3, so `resiplan.pipeline_module` is null and the script
                                       hands deepspeed.initialize its plain model (DeepSpeedEngine)
    dp_shard < dp (hybrid sharding)    refused: DeepSpeed 0.19 removed MiCS (mics_shard_size), its only hybrid
                                       sharding of all ZeRO state
    precision bf16                     bf16.enabled; with ZeRO-1 also data_types.grad_accum_dtype fp32, which
                                       makes DeepSpeed use its BF16_Optimizer (fp32 gradient accumulation)
    grad_precision bf16                data_types.grad_accum_dtype bf16, communication_data_type bf16
    grad_precision fp32, bf16 training with ZeRO-1: grad_accum_dtype fp32 (above); with ZeRO 0, 2 or 3 DeepSpeed
                                       has no fp32 accumulation (engine._do_optimizer_sanity_check refuses
                                       the mix at stage 0) and runs bf16 gradients: less memory and traffic
                                       than the plan counts
    precision fp16                     fp16.enabled with dynamic loss scaling (loss_scale 0)
    tp / pp / dp                       PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp) for the
                                       PipelineModule; its rank order (pipe, data, model; model fastest) is
                                       the plan's rank_devices order (tp fastest, then dp, then pp)
    tp > 1                             pipeline.pipe_partitioned / grad_partitioned (stage-to-stage tensors
                                       split over the TP group); the TP layers themselves are model code
    schedule 1f1b / gpipe              DeepSpeed's one training schedule, TrainSchedule (1F1B). A gpipe plan
                                       runs with the same bubble and at most its activation memory. With
                                       pp 1 any schedule is plain gradient accumulation.
    even layer split                   partition_method "type:transformer" (balances the layers whose class
                                       name matches the regex; embedding and head, which do not match, go to
                                       the first and last stage). The regex must match your transformer-layer
                                       class: Megatron-DeepSpeed's ParallelTransformerLayerPipe does; for,
                                       say, LlamaDecoderLayer use "type:LlamaDecoderLayer".
    uneven split                       partition_method "explicit", which is not a DeepSpeed method (a stock
                                       PipelineModule raises NotImplementedError on it, rather than quietly
                                       splitting evenly): `planned_pipeline_module` overrides
                                       PipelineModule._partition_layers with the plan's boundaries.
    recompute full                     pipeline.activation_checkpoint_interval 1 (every layer checkpointed)
                                       and an activation_checkpointing section; partition_activations when
                                       tp > 1 (the checkpoints split over the TP group, as the plan's
                                       sequence-parallel memory model assumes)
    recompute selective                activation_checkpoint_interval 0: see below
    recompute none                     activation_checkpoint_interval 0
    gradient clipping                  gradient_clipping 1.0 (not part of a plan; Megatron-LM's default)
    mixture of experts, ep             expert_parallel {enabled, autoep_size ep, expert_tensor_parallel_size 1}:
                                       DeepSpeed's AutoEP swaps a Hugging Face model's MoE blocks (Mixtral,
                                       Qwen3-MoE, Qwen3.5-MoE, DeepSeek-V2/V3, MiniMax-M3, detected from
                                       config.model_type) for dropless grouped-GEMM layers holding experts / ep
                                       whole experts each; its EP groups are ep consecutive ranks, the plan's ep
                                       consecutive replicas (tp 1, pp 1 only: see below); DeepSpeedEngine, no
                                       PipelineModule, at every ZeRO stage
    moe_dispatcher alltoall / flex     expert_parallel.comm_backend "comm" (all-to-all) / "deepep" (DeepEP)

Where DeepSpeed is not what the plan assumed, and refusals:

- Selective recompute. DeepSpeed's config can only checkpoint whole layers
  (every `activation_checkpoint_interval` layers); it has no attention-core
  recompute. The planner's selective mode saves only the attention score
  matrix, which a fused attention kernel (torch SDPA, FlashAttention) never
  stores, so the export asks for no layer checkpointing and the model's
  attention must use such a kernel (or Megatron-DeepSpeed's
  `--recompute-granularity selective`). With an unfused attention, re-plan
  with `"training": {"recompute": "full"}`.
- Tensor and sequence parallelism are model code (Megatron-DeepSpeed's
  mpu and tensor-parallel layers, `--sequence-parallel`): DeepSpeed's config
  has no field for them, and DeepSpeed checks nothing about heads; the
  export refuses a plan whose TP does not divide the heads itself.
- ZeRO-0 with bf16. DeepSpeed's pipeline engine puts every bf16 pipeline on
  its BF16_Optimizer, which shards fp32 master weights and Adam states over
  data-parallel ranks anyway, and without ZeRO it accumulates gradients in
  bf16 (it refuses fp32 accumulation without ZeRO). Memory is at most the
  plan's; gradient accumulation is less exact than the plan's fp32.
- Layer split inside a stage. `activation_checkpoint_interval` counts the
  PipelineModule's layers, so on the first and last stage the embedding and
  head are checkpointed units too.
- Mixture-of-experts plans run on AutoEP only as tp 1, pp 1 (ZeRO 0-3): AutoEP
  swaps the MoE blocks of a plain Hugging Face model, which DeepSpeed's
  PipelineEngine does not run (pp > 1 is refused), and its tensor
  parallelism (AutoTP folding) keeps activations whole on every TP rank, where
  the plan counted them split by sequence parallelism (tp > 1 is refused). It
  has no expert tensor parallelism and no batch-level all-to-all overlap
  (`moe_a2a_overlap` plans are refused). GPT-OSS is refused: AutoEP has no
  preset for it and leaves a model type it does not recognize unchanged,
  without an error. Megatron-DeepSpeed's own MoE
  (`deepspeed.moe.layer.MoE`) is not exported: it drops tokens over a
  capacity factor and replicates experts across TP ranks, neither of which
  the plan prices.
- Refused: interleaved (v > 1) plans (DeepSpeed's PipelineEngine holds one
  model chunk per stage), zero-bubble (zb-h1, zb-h2) and resiplan's optimized
  schedules (TrainSchedule has no split backward or custom order), plans
  whose TP collectives are priced overlapped (`tp_comm_overlap` megatron or
  async_tp: DeepSpeed overlaps none), and every non-uniform plan
  (`stock_layout` names what differs). Ask for a runnable
  plan with `"options": {"allow_non_uniform": false, "schedules": ["1f1b"]}`.

The `resiplan` section also carries the model: `model` is the plan's whole
architecture (normalization, RoPE base and scaling, biases, tying, GQA), and
`megatron_deepspeed.args` the Megatron-DeepSpeed pretrain_gpt.py flags that
build it (adapters.megatron_model), or `args: null` and `cannot_build` with
the reason (Megatron-DeepSpeed has no Q, K, V-only biases and no Llama 3.1
RoPE scaling).

`launch_command` uses DeepSpeed's launcher (`deepspeed --hostfile --include`)
when it places every rank on its planned GPU, and `torchrun` lines per node
otherwise (see there). The training script is `"${TRAIN_SCRIPT:?...}"`: the
plan cannot know it, so the printed command stops, naming the variable,
until it is set; the script's own settings (data, tokenizer, iterations,
learning rate) follow `--deepspeed_config`, as the comments say.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from adapters.megatron_model import megatron_deepspeed_model_args
from adapters.registry import ExportError
from adapters.shell_text import Required, inert
from adapters.stock import StockLayout, check_replica, launch_blocks, stock_layout
from wire.schemas import Plan

TARGET = "DeepSpeed"
RESIPLAN_KEY = "resiplan"
CONFIG_FILE = "ds_config.json"
HOSTFILE = "resiplan-hostfile"
# What every launcher line runs: the user's script, which the plan cannot know (bash stops, naming the
# variable, while it is unset), and the config this plan exports.
SCRIPT = Required("", "TRAIN_SCRIPT", f"your training script, which builds the PipelineModule from the "
                                       f"resiplan section of {CONFIG_FILE}")
REQUIRED = (SCRIPT,)
TRAIN_SCRIPT_VARIABLE = SCRIPT.variable
TRAIN = f"{SCRIPT.value()} --deepspeed --deepspeed_config {CONFIG_FILE}"
MASTER_PORT = 29500
GRADIENT_CLIPPING = 1.0
EVEN_PARTITION_METHOD = "type:transformer"
EXPLICIT_PARTITION_METHOD = "explicit"
# plan schedules DeepSpeed's TrainSchedule (1F1B) runs as planned or better
RUNNABLE_SCHEDULES = frozenset({"1f1b", "gpipe"})
ASK_FOR_RUNNABLE = 'ask for a plan DeepSpeed runs with "options": {"allow_non_uniform": false, "schedules": ["1f1b"]}'
SCHEDULE_REASONS = {
    "interleaved": "DeepSpeed's PipelineEngine holds one model chunk per stage and has no interleaved schedule",
    "zb-h1": "DeepSpeed's TrainSchedule has no split (input/weight-gradient) backward",
    "zb-h2": "DeepSpeed's TrainSchedule has no split (input/weight-gradient) backward",
    "optimized": "DeepSpeed runs only its own 1F1B order (TrainSchedule), not a solver-made one",
    "looped-bfs": "DeepSpeed's PipelineEngine holds one model chunk per stage and has no breadth-first schedule",
}


def render(plan: Plan, replica_id: int | None = None) -> str:
    """The DeepSpeed config with the `resiplan` section, as JSON. Every replica runs the same config."""
    check_replica(plan, replica_id)
    return json.dumps(document(plan), indent=2) + "\n"


def document(plan: Plan) -> dict[str, Any]:
    """`deepspeed_config(plan)` plus the `resiplan` key: the settings that go into the training script."""
    layout = _layout(plan)
    return {**_config(layout), RESIPLAN_KEY: _script_settings(plan, layout)}


def deepspeed_config(plan: Plan) -> dict[str, Any]:
    """The DeepSpeed config proper (what DeepSpeedConfig parses). ExportError when DeepSpeed cannot run the plan."""
    return _config(_layout(plan))


def pipeline_parts(boundaries: Sequence[int], first_transformer_index: int, num_layers: int) -> list[int]:
    """PipelineModule `parts` (stage s builds layers[parts[s]:parts[s+1]]) from the plan's transformer boundaries.

    boundaries: `transformer_layer_boundaries` of the export (pp + 1 entries, 0 .. num transformer layers).
    first_transformer_index: where the first transformer layer sits in your layer list (after the embedding).
    num_layers: the length of your layer list. Layers before the first transformer layer go to the first
    stage, layers after the last one (final norm, head, loss) to the last stage, as the plan assumes.
    """
    boundaries = list(boundaries)
    transformer_layers = boundaries[-1]
    if boundaries[0] != 0 or boundaries != sorted(boundaries) or len(boundaries) < 2:
        raise ValueError(f"boundaries {boundaries} are not increasing from 0")
    if not 0 <= first_transformer_index <= num_layers - transformer_layers:
        raise ValueError(f"{transformer_layers} transformer layers from index {first_transformer_index} do not fit "
                         f"in {num_layers} layers")
    return [0] + [first_transformer_index + b for b in boundaries[1:-1]] + [num_layers]


def planned_pipeline_module(layers: Sequence[Any], parts: Sequence[int], **kwargs: Any) -> Any:
    """A deepspeed.pipe.PipelineModule that builds the stage split `parts` instead of computing one.

    DeepSpeed's `partition_method` ("parameters", "uniform", "type:regex") balances a weight per
    layer, so it cannot reproduce an arbitrary split; PipelineModule._partition_layers is the one
    place that sets `self.parts`, and this subclass overrides it. kwargs go to PipelineModule
    (`topology` or `num_stages`, `loss_fn`, `activation_checkpoint_interval`, ...);
    `partition_method` is ignored. Needs deepspeed and an initialized deepspeed.comm, as
    PipelineModule itself does.
    """
    from deepspeed.pipe import PipelineModule

    planned = [int(p) for p in parts]
    layers = list(layers)
    if planned[0] != 0 or planned[-1] != len(layers) or planned != sorted(planned):
        raise ValueError(f"parts {planned} do not cut {len(layers)} layers in order")

    class PlannedPipelineModule(PipelineModule):
        def _partition_layers(self, method: str = "uniform") -> None:
            if len(planned) != self.num_stages + 1:
                raise ValueError(f"parts {planned} describe {len(planned) - 1} stages, the topology has "
                                 f"{self.num_stages}")
            self.parts = list(planned)
            stage_id = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])

    return PlannedPipelineModule(layers, **{k: v for k, v in kwargs.items() if k != "partition_method"})


def launch_command(plan: Plan) -> str:
    """Shell lines that start the training script on the plan's GPUs, rank r on `rank_devices[r]`.

    DeepSpeed's launcher numbers ranks host by host in hostfile order, sorts each host's
    --include slots into CUDA_VISIBLE_DEVICES, and gives the process of global rank r
    LOCAL_RANK r % (processes on its host) (deepspeed/launcher/launch.py), so it places
    rank r on the planned GPU only when every host's planned GPUs, in rank order, are the
    ones that rule picks: always with whole nodes, often not when nodes run different numbers
    of GPUs (8 then 6: rank 8 gets LOCAL_RANK 2). Then it is one `deepspeed` line (with a hostfile naming resiplan node N `nodeN`,
    which must reach that node over passwordless ssh). Otherwise there is a `torchrun` line
    per node: torchrun gives node rank k the ranks after those of node ranks 0..k-1 and local
    rank i the i-th visible GPU, and DeepSpeed reads RANK/LOCAL_RANK/WORLD_SIZE from it.
    """
    layout = _layout(plan)
    blocks = launch_blocks(layout, "DeepSpeed's launcher")
    lines = [
        (f"# resiplan plan {inert(plan.plan_id)}: {TARGET} on {layout.world_size} GPUs (tp {layout.tp}, pp {layout.pp}, "
         f"dp {layout.dp}) on {len(blocks)} node(s)"),
        f"# {CONFIG_FILE}: this plan exported with --format deepspeed, in the directory the script runs in",
        f"# still to set: {TRAIN_SCRIPT_VARIABLE}, your training script; its own settings (data, tokenizer, iterations,",
        "#   learning rate) go after --deepspeed_config; Megatron-DeepSpeed's pretrain_gpt.py also takes the model",
        f"#   flags in {CONFIG_FILE}'s resiplan.megatron_deepspeed.args",
    ]
    if deepspeed_launcher_places(blocks):
        return "\n".join(lines + deepspeed_launcher_lines(blocks, layout.gpus_per_node)) + "\n"
    lines.append("# DeepSpeed's launcher would put some ranks on other GPUs of their node (its LOCAL_RANK is the "
                 "global rank modulo the node's process count): one torchrun per node")
    rendezvous = (f"--nnodes={len(blocks)} --master_addr=\"${{MASTER_ADDR:?address of node {blocks[0][0]}}}\" "
                  f"--master_port={MASTER_PORT}")
    for rank, (node, gpus) in enumerate(blocks):
        lines.append(f"# on node {node}")
        lines.append(f"CUDA_VISIBLE_DEVICES={','.join(map(str, gpus))} torchrun {rendezvous} "
                     f"--nproc_per_node={len(gpus)} --node_rank={rank} {TRAIN}")
    return "\n".join(lines) + "\n"


def deepspeed_launcher_lines(blocks: Sequence[tuple[int, Sequence[int]]], gpus_per_node: int) -> list[str]:
    """The `deepspeed` launcher lines that start one process on each GPU of `blocks` ((node, GPUs) in rank order).

    Where each rank runs follows DeepSpeed's rule (see deepspeed_launcher_places), not necessarily
    the blocks' order.
    """
    if len(blocks) == 1:
        node, gpus = blocks[0]
        return [f"# on node {node}",
                f"deepspeed --include localhost:{_slots(gpus)} --master_port {MASTER_PORT} {TRAIN}"]
    include = "@".join(f"node{node}:{_slots(gpus)}" for node, gpus in blocks)
    return [
        "# host nodeN is resiplan node N, reachable over passwordless ssh; ranks go host by host in this order",
        f"cat > {HOSTFILE} <<'RESIPLAN_HOSTS'",
        *(f"node{node} slots={gpus_per_node}" for node, _ in blocks),
        "RESIPLAN_HOSTS",
        f"deepspeed --hostfile {HOSTFILE} --include {include} --master_port {MASTER_PORT} {TRAIN}",
    ]


def deepspeed_launcher_places(blocks: Sequence[tuple[int, Sequence[int]]]) -> bool:
    """Whether DeepSpeed's launcher, given each node's GPUs as --include slots, runs rank r on block GPU r.

    blocks: (node, its GPUs in rank order) in rank order. launch.py sorts the slots into
    CUDA_VISIBLE_DEVICES and sets LOCAL_RANK = global rank % processes on the node.
    """
    first = 0
    for _, gpus in blocks:
        visible = sorted(gpus)
        if any(visible[(first + i) % len(gpus)] != gpu for i, gpu in enumerate(gpus)):
            return False
        first += len(gpus)
    return True


# ---------------------------------------------------------------------------------------------------------------


def _layout(plan: Plan) -> StockLayout:
    schedule_problems = []
    # one stage has no pipeline to schedule: every schedule is sequential microbatches with gradient accumulation
    single_stage = plan.virtual_stages == 1 and all(len(replica.stages) == 1 for replica in plan.replicas)
    if plan.schedule not in RUNNABLE_SCHEDULES and not single_stage:
        reason = SCHEDULE_REASONS.get(plan.schedule, "DeepSpeed runs only 1F1B (TrainSchedule)")
        schedule_problems.append(f'its pipeline schedule "{plan.schedule}" ({reason})')
    if plan.virtual_stages > 1:
        schedule_problems.append(f"it has {plan.virtual_stages} virtual stages per GPU (DeepSpeed's PipelineModule "
                                 "holds one contiguous run of layers per stage)")
    try:
        layout = stock_layout(plan, TARGET)
    except ExportError as error:
        if not schedule_problems:
            raise
        raise ExportError(f"{error}; and {'; '.join(schedule_problems)}; {ASK_FOR_RUNNABLE}") from None
    problems = list(schedule_problems)
    expected = layout.micro_batch_size * layout.num_microbatches * layout.dp
    if layout.global_batch_size != expected:
        problems.append(f"global_batch_size {layout.global_batch_size} is not micro_batch_size "
                        f"{layout.micro_batch_size} x {layout.num_microbatches} microbatches x dp {layout.dp}, "
                        "the train_batch_size DeepSpeed asserts")
    architecture = layout.architecture
    for what, count in (("attention heads", architecture.num_attention_heads), ("KV heads", architecture.num_kv_heads)):
        if count % layout.tp:
            problems.append(f"tp {layout.tp} does not divide the model's {count} {what}")
    if layout.zero_stage >= 2 and layout.pp > 1:
        problems.append(f"zero_stage {layout.zero_stage} with pp {layout.pp} (DeepSpeed's PipelineEngine runs ZeRO "
                        "stage 0 or 1; ZeRO-2/3 run without pipeline parallelism)")
    if layout.zero_stage >= 1 and layout.shard_groups > 1:
        problems.append(f"hybrid sharding (dp_shard {layout.shard_replicas} of {layout.dp} replicas): DeepSpeed "
                        "0.19 removed MiCS, its hybrid sharding (DeepSpeedConfig refuses mics_shard_size); export to "
                        'megatron or torchtitan, or plan with "options": {"allow_hybrid_sharding": false}')
    if layout.cp > 1:
        problems.append(f"context parallelism cp {layout.cp} (DeepSpeed's config splits sequences only with "
                        "Ulysses sequence parallelism, an all-to-all over attention heads the plan did not price; "
                        'export to megatron or torchtitan, or plan with "options": {"max_context_parallel": 1})')
    if architecture.num_experts:
        problems += _expert_problems(layout)
    if layout.tp_comm_overlap != "none":
        problems.append(f"tp_comm_overlap {layout.tp_comm_overlap} (DeepSpeed overlaps no tensor-parallel "
                        'collective with its GEMMs; plan with "training": {"tp_comm_overlap": "none"})')
    if layout.precision == "fp8":
        problems.append("precision fp8 (DeepSpeed's config has no FP8 training: FP8 comes from Transformer Engine "
                        "layers in the model code; export to megatron or torchtitan, or plan with precision bf16)")
    elif layout.precision not in ("bf16", "fp16"):
        problems.append(f"precision {layout.precision!r}")
    if layout.recompute not in ("none", "selective", "full"):
        problems.append(f"recompute mode {layout.recompute!r}")
    if problems:
        raise ExportError(f"{TARGET} cannot run this plan: {'; '.join(problems)}; {ASK_FOR_RUNNABLE}")
    return layout


def _expert_problems(layout: StockLayout) -> list[str]:
    """What AutoEP, DeepSpeed's expert parallelism, cannot run of a mixture-of-experts plan."""
    problems = []
    if layout.architecture.attention_sinks:
        # A model type AutoEP has no preset for is left as it is, without an error: its experts would stay whole
        # on every rank.
        problems.append("a GPT-OSS-style mixture of experts (DeepSpeed 0.19's AutoEP has no preset for its routers, "
                        "biased experts and clamped SwiGLU, and leaves a model it does not recognize unchanged, every "
                        "expert on every rank)")
    if layout.pp > 1:
        problems.append(f"a mixture of experts with pp {layout.pp} (DeepSpeed's AutoEP swaps the MoE blocks of a "
                        "Hugging Face model run by its plain engine, not a PipelineModule)")
    if layout.tp > 1:
        problems.append(f"a mixture of experts with tp {layout.tp} (AutoEP's tensor parallelism, AutoTP folding, "
                        "keeps activations whole on every TP rank where the plan splits them by sequence "
                        "parallelism, and it has no expert tensor parallelism)")
    if layout.moe_a2a_overlap:
        problems.append("moe_a2a_overlap (AutoEP has no batch-level overlap of the all-to-alls; plan with "
                        '"training": {"moe_a2a_overlap": false})')
    if problems:
        problems[-1] += ("; for DeepSpeed, estimate a tp 1, pp 1 layout (POST /v1/estimate with \"layout\": "
                         f'{{"tp": 1, "pp": 1, "ep": {layout.ep}}}), or export to megatron or torchtitan')
    return problems


def _config(layout: StockLayout) -> dict[str, Any]:
    full = layout.recompute == "full"
    config: dict[str, Any] = {
        "train_batch_size": layout.global_batch_size,
        "train_micro_batch_size_per_gpu": layout.micro_batch_size,
        "gradient_accumulation_steps": layout.num_microbatches,
        "gradient_clipping": GRADIENT_CLIPPING,
        "zero_optimization": {"stage": layout.zero_stage},
    }
    if layout.zero_stage >= 2:
        # The collectives under compute, as cost_models.sharded_dp prices them (ZeRO-3 prefetches by default).
        config["zero_optimization"]["overlap_comm"] = True
    if layout.precision == "bf16":
        config["bf16"] = {"enabled": True}
        if layout.grad_precision == "bf16":
            config["data_types"] = {"grad_accum_dtype": "bf16"}
            config["communication_data_type"] = "bf16"
        elif layout.zero_stage == 1:
            config["data_types"] = {"grad_accum_dtype": "fp32"}
    else:
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                          "hysteresis": 2, "min_loss_scale": 1}
    if layout.architecture.num_experts:
        # AutoEP: dropless grouped GEMMs over ep consecutive ranks, whole experts (no expert-TP)
        config["expert_parallel"] = {
            "enabled": True,
            "autoep_size": layout.ep,
            "expert_tensor_parallel_size": 1,
            "comm_backend": "deepep" if layout.moe_dispatcher == "flex" else "comm",
        }
    if _pipelined(layout):
        config["pipeline"] = {
            "activation_checkpoint_interval": 1 if full else 0,
            "pipe_partitioned": layout.tp > 1,
            "grad_partitioned": layout.tp > 1,
        }
    if full:
        config["activation_checkpointing"] = {
            "partition_activations": layout.tp > 1,
            "contiguous_memory_optimization": False,
            "cpu_checkpointing": False,
            "synchronize_checkpoint_boundary": False,
            "profile": False,
        }
    return config


def _pipelined(layout: StockLayout) -> bool:
    """Whether the script builds a PipelineModule (DeepSpeed's PipelineEngine): always, except for ZeRO-2/3,
    which only the plain DeepSpeedEngine runs, and a mixture of experts, whose MoE blocks AutoEP swaps in a plain
    model (`_layout` refuses both with pp > 1)."""
    return layout.zero_stage <= 1 and not layout.architecture.num_experts


def _script_settings(plan: Plan, layout: StockLayout) -> dict[str, Any]:
    boundaries = [0]
    for count in layout.layers_per_stage:
        boundaries.append(boundaries[-1] + count)
    even = len(set(layout.layers_per_stage)) == 1
    recompute = {
        "none": "no activation checkpointing",
        "selective": "no layer checkpointing: the model's attention must be a fused kernel (torch SDPA, "
                     "FlashAttention), which never stores the score matrix selective recompute drops",
        "full": "activation_checkpoint_interval 1: every layer's forward runs again in backward" if _pipelined(layout)
                else "every layer checkpointed by the model (deepspeed.checkpointing.checkpoint)",
    }[layout.recompute]
    return {
        "plan_id": plan.plan_id,
        "engine": _engine(layout),
        "pipeline_module": None if not _pipelined(layout) else {
            "num_stages": layout.pp,
            "topology": {"class": "PipeModelDataParallelTopology", "num_pp": layout.pp, "num_mp": layout.tp,
                         "num_dp": layout.dp},
            "partition_method": EVEN_PARTITION_METHOD if even else EXPLICIT_PARTITION_METHOD,
            "transformer_layers_per_stage": list(layout.layers_per_stage),
            "transformer_layer_boundaries": boundaries,
            "activation_checkpoint_interval": 1 if layout.recompute == "full" else 0,
        },
        "tensor_parallel": {"size": layout.tp, "sequence_parallel": layout.sequence_parallel},
        "expert_parallel": None if not layout.architecture.num_experts else {
            "size": layout.ep,
            "experts_per_gpu": layout.architecture.num_experts // layout.ep,
            "deepspeed": "AutoEP (the config's expert_parallel section): deepspeed.initialize swaps the Hugging Face "
                         "model's MoE blocks, found from config.model_type, for layers holding these experts; it "
                         "leaves a model it does not recognize unchanged, so check that its log says 'AutoEP: "
                         "replaced N MoE layer(s)' with N the model's expert layers",
        },
        "schedule": {"plan": layout.schedule,
                     "deepspeed": "TrainSchedule (1F1B)" if layout.pp > 1 else "gradient accumulation (one stage)"},
        "recompute": {"plan": layout.recompute, "deepspeed": recompute},
        "model": layout.architecture.model_dump(),
        "megatron_deepspeed": _megatron_deepspeed(layout),
        "seq_length": layout.seq_length,
        "world_size": layout.world_size,
        "rank_devices": list(layout.rank_devices),
    }


def _engine(layout: StockLayout) -> str:
    if _pipelined(layout):
        return "PipelineEngine (a PipelineModule)"
    if layout.architecture.num_experts:
        return ("DeepSpeedEngine: a mixture of experts runs on AutoEP without a PipelineModule; pass the plain "
                "Hugging Face model")
    return f"DeepSpeedEngine: ZeRO-{layout.zero_stage} runs without a PipelineModule; pass the plain model"


def _megatron_deepspeed(layout: StockLayout) -> dict[str, Any]:
    """Megatron-DeepSpeed pretrain_gpt.py's model flags for the plan's architecture, or why it has none."""
    try:
        return {"args": megatron_deepspeed_model_args(layout.architecture, layout.seq_length)}
    except ExportError as error:
        return {"args": None, "cannot_build": str(error)}


def _slots(gpus: Sequence[int]) -> str:
    return ",".join(map(str, sorted(gpus)))
