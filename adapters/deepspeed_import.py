"""A DeepSpeed config, with the Megatron-DeepSpeed command line it runs beside, read back into a resiplan
estimate request; every setting that changes time or memory is mapped or reported as not modelled.

    ds_config                                          request
    train_batch_size                                   training.global_batch_size
    train_micro_batch_size_per_gpu                     layout.micro_batch_size
    gradient_accumulation_steps, with the batch        layout.dp = train_batch_size / (micro x accumulation)
    zero_optimization.stage 0-3                        training.zero_stage (other values refused, as DeepSpeed does)
    data_types.grad_accum_dtype (bf16 training)        training.grad_precision: fp32 if fp32, else bf16 (DeepSpeed's
                                                       default accumulates in the model's dtype)
    bf16.enabled / fp16.enabled                        training.precision
    pipeline.activation_checkpoint_interval 1          layout.recompute full (0: none; others reported)
    expert_parallel.autoep_size (AutoEP enabled)       layout.ep (expert_tensor_parallel_size must be 1, as AutoEP
                                                       requires; tp 1: AutoEP refuses Megatron-DeepSpeed's TP)
    expert_parallel.comm_backend comm / deepep         training.moe_dispatcher alltoall / flex
    "resiplan" (what the DeepSpeed export adds)        the PipelineModule's stages, split and TP size, and the model

The model, tp and pp come from the Megatron-DeepSpeed pretrain_gpt.py flags (its spellings: --num-key-value-heads,
--layernorm-epsilon, --use-rotary-position-embeddings, --rotary-position-embeddings-theta), read as
`adapters.megatron_import` reads Megatron-LM's, or from the export's "resiplan" key when there are none.
"""

from __future__ import annotations

import shlex

from adapters.command_line import CommandLineError, Imported, command_words
from adapters.megatron_import import import_megatron

# Megatron-DeepSpeed's spellings of what Megatron-LM names otherwise (adapters.megatron_model's table).
_SPELLINGS = {
    "--num-key-value-heads": ["--group-query-attention", "--num-query-groups"],
    "--layernorm-epsilon": ["--norm-epsilon"],
    "--use-rotary-position-embeddings": ["--position-embedding-type", "rope"],
    "--rotary-position-embeddings-theta": ["--rotary-base"],
    "--no-position-embedding": [],
    "--checkpoint-activations": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                 "--recompute-num-layers", "1"],
}
_KNOWN_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
               "zero_optimization", "bf16", "fp16", "pipeline", "activation_checkpointing", "resiplan", "data_types",
               "gradient_clipping", "communication_data_type", "expert_parallel"}
# AutoEP settings that change time or memory and are mapped (`_expert_parallel`); others are reported
_EXPERT_PARALLEL_KEYS = {"enabled", "autoep_size", "expert_tensor_parallel_size", "comm_backend"}
_DISPATCHERS = {"comm": "alltoall", "deepep": "flex"}
_NO_EFFECT_KEYS = {"optimizer", "scheduler", "steps_per_print", "wall_clock_breakdown", "tensorboard", "wandb",
                   "csv_monitor", "flops_profiler", "comms_logger", "gradient_clipping", "prescale_gradients",
                   "seed"}


def _megatron_spelling(args: str) -> str:
    launcher, words = command_words(args)
    out = []
    for word in words:
        out += _SPELLINGS.get(word, [word])
    return shlex.join([*launcher, "pretrain_gpt.py", *out])


def _number(config: dict, key: str) -> int | None:
    value = config.get(key)
    if value is None or value == "auto":
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CommandLineError(f"{key} {value!r} is not a positive whole number")
    return value


def _section(parent: dict, key: str, path: str = "") -> dict:
    """`parent[key]`, an object or absent/null ({}); anything else is a CommandLineError naming it (`path`: the
    keys leading to `parent`, "resiplan." inside the export's own section)."""
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CommandLineError(f"{path}{key} must be a JSON object, not {type(value).__name__}")
    return value


def import_deepspeed(config: dict, megatron_args: str | None = None, vocab_size: int | None = None) -> Imported:
    """The estimate request (less its cluster) a DeepSpeed config and its Megatron-DeepSpeed flags describe."""
    if not isinstance(config, dict):
        raise CommandLineError("deepspeed_config must be a JSON object")
    exported = config.get("resiplan") if isinstance(config.get("resiplan"), dict) else None
    notes: list[str] = []
    not_modelled: list[str] = []
    if megatron_args:
        imported = import_megatron(_with_config_flags(_megatron_spelling(megatron_args), config), vocab_size=vocab_size)
        model, layout = imported.request["model"], dict(imported.request["layout"])
        seq = imported.request["training"]["seq_length"]
        not_modelled += imported.not_modelled
        notes += imported.notes
        ignored = list(imported.ignored)
    elif exported is not None:
        module = _section(exported, "pipeline_module", "resiplan.")  # null: a ZeRO-2/3 export, one stage, no PipelineModule
        model = {k: v for k, v in _section(exported, "model", "resiplan.").items() if k != "name"}
        split = module.get("transformer_layers_per_stage") or []
        if not isinstance(split, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in split):
            raise CommandLineError("resiplan.pipeline_module.transformer_layers_per_stage must list whole numbers")
        tp = _section(exported, "tensor_parallel", "resiplan.").get("size", 1)
        layout = {"tp": tp, "pp": module.get("num_stages", 1), "virtual_stages": 1, "schedule": "1f1b"}
        if len(set(split)) > 1:
            layout["layers_per_stage"] = split
        seq, ignored = exported.get("seq_length"), []
        notes.append("the model, stages and TP size are the export's (the config's \"resiplan\" key)")
    else:
        raise CommandLineError("a DeepSpeed config does not say the model or how it is split: give the "
                               "Megatron-DeepSpeed command line beside it (megatron_args)")
    if seq is None:
        raise CommandLineError("the sequence length is not given (--seq-length)")
    batch = _number(config, "train_batch_size")
    mbs = _number(config, "train_micro_batch_size_per_gpu") or layout.get("micro_batch_size", 1)
    steps = _number(config, "gradient_accumulation_steps")
    if batch is None:
        raise CommandLineError("train_batch_size is not given: resiplan cannot estimate without the global batch")
    if steps is not None:
        if batch % (mbs * steps):
            raise CommandLineError(f"train_batch_size {batch} is not micro {mbs} x accumulation {steps} x some dp: "
                                   "DeepSpeed refuses such a config too")
        layout["dp"] = batch // (mbs * steps)
    layout["micro_batch_size"] = mbs
    stage = _section(config, "zero_optimization").get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise CommandLineError(f"zero_optimization.stage {stage!r}: DeepSpeed's ZeRO stages are 0, 1, 2 and 3")
    interval = _section(config, "pipeline").get("activation_checkpoint_interval", 0)
    if interval not in (0, 1):
        not_modelled.append(f"pipeline.activation_checkpoint_interval {interval}: checkpointing every "
                            f"{interval} layers is estimated as every layer")
    if interval:
        layout["recompute"] = "full"
    elif megatron_args is None:  # the export's: DeepSpeed's config has no selective recompute of its own
        layout["recompute"] = (exported.get("recompute") or {}).get("plan", "none")
    training = {"global_batch_size": batch, "seq_length": seq, "zero_stage": stage,
                "precision": _precision(config)}
    # DeepSpeed accumulates gradients in the model's dtype unless data_types.grad_accum_dtype says otherwise
    # (engine.get_data_types); fp32 accumulation in bf16 training exists with ZeRO-1 only (its BF16_Optimizer).
    if training["precision"] == "bf16" and _section(config, "data_types").get("grad_accum_dtype") in (None, "bf16"):
        training["grad_precision"] = "bf16"
    _expert_parallel(config, model, layout, training, not_modelled)
    for key in sorted(config):
        if key in _NO_EFFECT_KEYS:
            ignored.append(key)
        elif key not in _KNOWN_KEYS:
            not_modelled.append(f"{key}: not a DeepSpeed setting resiplan knows; its effect on time and memory is "
                                "not modelled")
    return Imported(request={"model": model, "training": training, "layout": layout}, not_modelled=not_modelled,
                    ignored=sorted(set(ignored)), notes=notes)


def _expert_parallel(config: dict, model: dict, layout: dict, training: dict, not_modelled: list[str]) -> None:
    """AutoEP's section (DeepSpeed 0.19: `expert_parallel`) into the layout's ep and the training's dispatcher."""
    section = config.get("expert_parallel")
    if section is None:
        return
    if not isinstance(section, dict):
        raise CommandLineError("expert_parallel must be a JSON object")
    if not section.get("enabled", False):
        return
    ep = _number(section, "autoep_size") or 1
    if section.get("expert_tensor_parallel_size", 1) != 1:
        raise CommandLineError(f"expert_parallel.expert_tensor_parallel_size {section['expert_tensor_parallel_size']!r}"
                               ": DeepSpeed's AutoEP runs only 1 (whole experts per GPU), and refuses others")
    if layout.get("tp", 1) != 1:
        raise CommandLineError(f"expert_parallel with tp {layout['tp']}: AutoEP refuses Megatron-DeepSpeed's tensor "
                               "parallelism, and its own (AutoTP folding) is not imported by resiplan")
    backend = section.get("comm_backend", "comm")
    if backend not in _DISPATCHERS:
        raise CommandLineError(f"expert_parallel.comm_backend {backend!r}: AutoEP's are \"comm\" and \"deepep\"")
    if not (model.get("num_experts") if isinstance(model, dict) else None):
        not_modelled.append("expert_parallel: the model has no experts to place")
        return
    layout["ep"] = ep
    training["moe_dispatcher"] = _DISPATCHERS[backend]
    not_modelled += [f"expert_parallel.{key}: not an AutoEP setting resiplan models" for key in sorted(section)
                     if key not in _EXPERT_PARALLEL_KEYS]


def _precision(config: dict) -> str:
    bf16 = bool(_section(config, "bf16").get("enabled"))
    fp16 = bool(_section(config, "fp16").get("enabled"))
    if bf16 and fp16:
        raise CommandLineError("bf16 and fp16 both enabled: DeepSpeed refuses that too")
    if not (bf16 or fp16):
        raise CommandLineError("neither bf16 nor fp16 is enabled: DeepSpeed would train in fp32, which resiplan does "
                               "not model")
    return "bf16" if bf16 else "fp16"


def _with_config_flags(args: str, config: dict) -> str:
    """The command line with what Megatron-DeepSpeed may take from the config instead (the precision, the global
    and micro batch), where it does not say them itself; the config's values are the ones used either way."""
    words = shlex.split(args)
    extra = [] if {"--bf16", "--fp16"} & set(words) else [f"--{_precision(config)}"]
    for flag, key in (("--global-batch-size", "train_batch_size"), ("--micro-batch-size", "train_micro_batch_size_per_gpu")):
        if flag not in words and _number(config, key) is not None:
            extra += [flag, str(config[key])]
    return shlex.join([*words, *extra])
