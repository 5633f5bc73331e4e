"""torchtitan settings read back into a resiplan estimate request: `--section.field value` overrides (torchtitan
0.3, as `adapters.torchtitan` writes them and as a launch command passes them), optionally on top of an older
torchtitan's TOML job file, with every setting that changes time or memory mapped or reported as not modelled.

    torchtitan                                           request
    --parallelism.tensor_parallel_degree / pipeline_...  layout.tp / layout.pp
    --parallelism.context_parallel_degree                layout.cp (cp > 1: FSDP over dp_shard x cp, so at
                                                         least zero_stage 1)
    --parallelism.expert_parallel_degree                 layout.ep (with tp > 1: and etp 1, whole experts)
    data_parallel_replicate_degree x _shard_degree       layout.dp (shard -1: what torchrun's ranks leave)
    both > 1 (HSDP)                                      layout.dp_shard = data_parallel_shard_degree
    data_parallel_shard_degree > 1                       training.zero_stage 3 (FSDP2 resharding after forward:
                                                         fsdp_reshard_after_forward always, or default with pp 1),
                                                         else 1 (never; default with pp > 1, where torchtitan keeps
                                                         parameters whole between forward and backward)
    --parallelism.pipeline_parallel_microbatch_size      layout.micro_batch_size (pp > 1; else local_batch_size)
    --training.global_batch_size, --training.seq_len     training (global -1: local_batch_size x dp)
    --parallelism.pipeline_parallel_schedule             GPipe / 1F1B / Interleaved1F1B / LoopedBFS by name
    pipeline_parallel_layers_per_stage L                 layout.virtual_stages = ceil((layers + f + l) / L) / pp
    pipeline_parallel_first/last_stage_less_layers f, l  the split torchtitan cuts (default 1 and 1: the embedding
                                                         and the output each weigh a layer): layout.layers_per_stage,
                                                         or layout.layers_per_chunk with virtual stages
    module_fqns_per_model_part                           the same, from each part's layers
    activation_checkpoint:<mode>                         layout.recompute
    --training.mixed_precision_param                     training.precision (bfloat16; float32 is refused)
    --training.mixed_precision_reduce float32            fp32 gradients, the default (torchtitan 0.3 takes no other)
    --compile.enable_async_tensor_parallel (tp > 1)      training.tp_comm_overlap async_tp (also read where older
                                                         versions kept it: parallelism, experimental)
    --module M --config C                                model: torchtitan's own config functions that are a
                                                         resiplan preset field for field; any other needs `model`
"""

from __future__ import annotations

import tomllib

from adapters.command_line import CommandLineError, Imported, command_words, world_size
from adapters.torchtitan import BUILTIN_CONFIGS, NAMED_SCHEDULES
from cost_models.model_spec import model_preset

_SCHEDULES = {name: ours for ours, name in NAMED_SCHEDULES.items()}
_CHUNKED = {"interleaved", "looped-bfs"}
_PRECISIONS = {"bfloat16": "bf16"}
# Settings that change neither time nor memory of an iteration, by prefix.
_NO_EFFECT = ("--optimizer.", "--lr_scheduler.", "--dataloader.", "--checkpoint.", "--metrics.", "--job.",
              "--validation.", "--profiling.", "--hf_assets_path", "--training.steps", "--comm.", "--fault_tolerance.",
              "--training.seed", "--training.deterministic", "--training.max_norm", "--tokenizer.",
              "--training.dataset", "--debug.")
_NOT_MODELLED = {
    "--compile.": "torch.compile's speed-up is not in the cost model",
    "--quantize.": "quantization settings are not read: the request's precision decides (fp8 for float8 linears, "
                   "as the notes say); MX formats are not in the cost model",
    "--model.converters": "converters are not read: the request's precision decides (fp8 for float8 linears, as the "
                          "notes say)",
    "--parallelism.fsdp_reshard_after_forward": "FSDP resharding after forward under pipeline parallelism (weights "
                                                "gathered every microbatch, gradients whole until the last) is "
                                                "estimated as ZeRO-1",
    "--training.disable_cuda_graphs": "CUDA graphs are not in the cost model",
    "--activation_checkpoint.selective_ac_option": "torchtitan's selective policy is timed as Megatron-style "
                                                   "selective recompute",
}
# Asynchronous TP: torchtitan 0.3's CompileConfig field, and where older versions kept it.
_ASYNC_TP = ("--compile.enable_async_tensor_parallel", "--parallelism.enable_async_tensor_parallel",
             "--experimental.enable_async_tensor_parallel")
_MAPPED = {*_ASYNC_TP, 
    "--parallelism.tensor_parallel_degree", "--parallelism.pipeline_parallel_degree",
    "--parallelism.data_parallel_replicate_degree", "--parallelism.data_parallel_shard_degree",
    "--parallelism.context_parallel_degree", "--parallelism.expert_parallel_degree",
    "--parallelism.enable_sequence_parallel", "--parallelism.pipeline_parallel_microbatch_size",
    "--parallelism.pipeline_parallel_schedule", "--parallelism.pipeline_parallel_schedule_csv",
    "--parallelism.pipeline_parallel_layers_per_stage", "--parallelism.pipeline_parallel_first_stage_less_layers",
    "--parallelism.pipeline_parallel_last_stage_less_layers", "--parallelism.module_fqns_per_model_part",
    "--training.local_batch_size", "--training.global_batch_size", "--training.seq_len", "--training.dtype",
    "--training.mixed_precision_param", "--training.mixed_precision_reduce", "--activation_checkpoint.mode", "--module", "--config", "--model.name",
    "--model.flavor",
}


def _options(words: list[str]) -> tuple[dict[str, list[str]], str | None, list[str]]:
    """--key -> its values (none for a switch), the activation-checkpoint subcommand's mode, stray words."""
    options: dict[str, list[str]] = {}
    mode, stray, key = None, [], None
    for word in words:
        if word.startswith("--"):
            key = word
            options[key] = []
        elif word.startswith("activation_checkpoint:"):
            mode, key = word.split(":", 1)[1], None
        elif key is not None:
            options[key].append(word)
        else:
            stray.append(word)
    return options, mode, stray


def _from_toml(text: str) -> dict[str, list[str]]:
    """An older torchtitan's TOML job file as the overrides it stands for: [section] field = value."""
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise CommandLineError(f"the TOML job file does not parse: {error}") from None
    except RecursionError:  # tomllib recurses per nesting level; a job file nests a few
        raise CommandLineError("the TOML job file nests arrays or tables too deeply to parse") from None
    out = {}
    for section, fields in table.items():
        if not isinstance(fields, dict):
            continue
        for name, value in fields.items():
            values = value if isinstance(value, list) else [value]
            out[f"--{section}.{name}"] = [str(v).lower() if isinstance(v, bool) else str(v) for v in values]
    return out


# Options that may be 0 (layers the embedding and the output weigh), and the one that may be -1 (torchtitan's
# "the ranks left over"); every other whole-number option is a size or degree of at least 1.
_MAY_BE_ZERO = frozenset({"--parallelism.pipeline_parallel_first_stage_less_layers",
                          "--parallelism.pipeline_parallel_last_stage_less_layers"})
_MAY_BE_AUTO = frozenset({"--parallelism.data_parallel_shard_degree"})


def _int(options: dict, key: str, default: int | None) -> int | None:
    values = options.get(key)
    if not values:
        return default
    try:
        value = int(values[0])
    except ValueError:
        raise CommandLineError(f"{key} {values[0]!r} is not a whole number") from None
    least = 0 if key in _MAY_BE_ZERO else 1
    if value < least and not (key in _MAY_BE_AUTO and value == -1):
        raise CommandLineError(f"{key} {value} must be at least {least}" + (" (or -1: the ranks left over)"
                                                                             if key in _MAY_BE_AUTO else ""))
    return value


def import_torchtitan(text: str = "", toml: str | None = None, model: str | dict | None = None) -> Imported:
    """The estimate request (less its cluster) torchtitan settings describe: `text` a command line or overrides
    (CLI overrides win over `toml`, an older torchtitan's job file); `model` (a preset name or architecture)
    where `--module`/`--config` name none of torchtitan's own that resiplan knows."""
    launcher, words = command_words(text)
    cli, mode, stray = _options(words)
    options = {**(_from_toml(toml) if toml else {}), **cli}
    mode = mode or (options.get("--activation_checkpoint.mode") or [None])[0]
    notes: list[str] = []
    request_model = _model(options, model, notes)
    tp = _int(options, "--parallelism.tensor_parallel_degree", 1)
    pp = _int(options, "--parallelism.pipeline_parallel_degree", 1)
    cp = _int(options, "--parallelism.context_parallel_degree", 1)
    not_modelled = []
    ep, etp = _expert_parallel(_int(options, "--parallelism.expert_parallel_degree", 1), tp, not_modelled)
    replicate = _int(options, "--parallelism.data_parallel_replicate_degree", 1)
    shard = _int(options, "--parallelism.data_parallel_shard_degree", -1)
    world = world_size(launcher)
    if shard == -1:
        rest = world // (tp * cp * pp * replicate) if world else None
        shard = rest
    dp = replicate * shard if shard else None
    hybrid_shard = shard if shard and shard > 1 and replicate > 1 else None
    local = _int(options, "--training.local_batch_size", None)
    mbs = _int(options, "--parallelism.pipeline_parallel_microbatch_size", 1) if pp > 1 else (local or 1)
    seq = _int(options, "--training.seq_len", None)
    if seq is None:
        raise CommandLineError("--training.seq_len is not given: resiplan cannot estimate without the sequence length")
    batch = _int(options, "--training.global_batch_size", -1)
    if batch == -1:
        if local is None or dp is None:
            raise CommandLineError("the global batch is neither given (--training.global_batch_size) nor implied "
                                   "(--training.local_batch_size and the data-parallel degree)")
        batch = local * dp
    layout: dict = {"tp": tp, "pp": pp, "micro_batch_size": mbs, **_pipeline(options, pp, request_model, not_modelled, notes)}
    if dp is not None:
        layout["dp"] = dp
    if cp != 1:
        layout["cp"] = cp
    if ep != 1:
        layout["ep"] = ep
    if etp is not None:
        layout["etp"] = etp
    if hybrid_shard:
        layout["dp_shard"] = hybrid_shard
    layout["recompute"] = _recompute(mode, notes)
    precision = (options.get("--training.mixed_precision_param") or ["bfloat16"])[0]
    if precision not in _PRECISIONS:
        raise CommandLineError(f"--training.mixed_precision_param {precision}: resiplan models bf16 and fp16 training, "
                               "torchtitan 0.3 trains in bfloat16 or float32")
    # FSDP over the data-parallel ranks shards optimizer state (with one rank, the reshard setting says FSDP was asked).
    # With cp > 1 torchtitan runs FSDP over dp_shard x cp whatever dp_shard is (ParallelDims.fsdp_enabled).
    sharded = bool(shard and shard > 1) or cp > 1 or "--parallelism.fsdp_reshard_after_forward" in options
    reshard = (options.get("--parallelism.fsdp_reshard_after_forward") or ["default"])[0]
    fully_sharded = bool(shard and shard > 1) and pp == 1 and reshard in ("always", "default")
    training = {"global_batch_size": batch, "seq_length": seq, "zero_stage": 3 if fully_sharded else (1 if sharded else 0),
                "precision": _PRECISIONS[precision]}
    reduce = (options.get("--training.mixed_precision_reduce") or ["float32"])[0]
    if reduce != "float32":  # torchtitan 0.3's own config allows nothing else
        raise CommandLineError(f"--training.mixed_precision_reduce {reduce}: torchtitan 0.3 reduces gradients in "
                               "float32 only")
    if any(_switch_on(key, options[key]) for key in _ASYNC_TP if key in options) and tp > 1:
        training["tp_comm_overlap"] = "async_tp"
    notes.append("float8 linears are set in torchtitan's config function, not on its command line: the request "
                 'says bf16; make it "precision": "fp8" if your config converts the linears to float8')
    ignored = sorted(key for key in options if key.startswith(_NO_EFFECT))
    for key in sorted(options):
        if key in _MAPPED or key in ignored:
            continue
        why = next((reason for prefix, reason in _NOT_MODELLED.items() if key.startswith(prefix)),
                   "not a setting resiplan knows; its effect on time and memory is not modelled")
        if key == "--parallelism.fsdp_reshard_after_forward" and (options[key] == ["never"] or fully_sharded):
            continue  # ZeRO-1's traffic (never), or ZeRO-3's (always / default without PP): both mapped
        not_modelled.append(f"{key} {' '.join(options[key])}".strip() + f": {why}")
    if stray:
        notes.append(f"words that are not settings, left out: {' '.join(stray[:8])}")
    return Imported(request={"model": request_model, "training": training, "layout": layout},
                    not_modelled=not_modelled, ignored=ignored, notes=notes)


def _switch_on(key: str, values: list[str]) -> bool:
    """A boolean setting given as a bare switch, or with a value (a TOML job file's true)."""
    if not values:
        return True
    if values[0].lower() in ("true", "1", "false", "0"):
        return values[0].lower() in ("true", "1")
    raise CommandLineError(f"{key} {values[0]!r}: not a boolean (true or false)")


def _expert_parallel(ep: int, tp: int, not_modelled: list[str]) -> tuple[int, int | None]:
    """(layout.ep, layout.etp) for torchtitan's expert_parallel_degree: with tp > 1 torchtitan's EP ranks are
    ep consecutive ranks, TP ranks first, holding whole experts: expert-TP 1, exactly."""
    key = "--parallelism.expert_parallel_degree"
    if ep < 1:
        raise CommandLineError(f"{key} {ep} is not a degree (1 or more)")
    if ep == 1 or tp == 1:
        return ep, None
    if ep % tp:
        not_modelled.append(f"{key} {ep} with tp {tp}: expert groups that split TP groups are not in the cost model; "
                            "estimated without expert parallelism")
        return 1, None
    return ep, 1


def _model(options: dict, model: str | dict | None, notes: list[str]) -> str | dict:
    selection = ((options.get("--module") or [None])[0], (options.get("--config") or [None])[0])
    name, flavor = (options.get("--model.name") or [None])[0], (options.get("--model.flavor") or [None])[0]
    if selection == (None, None) and name and flavor:  # an older torchtitan's [model] name and flavor
        selection = (name, f"{name}_{flavor.lower()}")
    preset = BUILTIN_CONFIGS.get(selection)
    if preset is not None:
        if model is not None and model != preset:
            raise CommandLineError(f"--module {selection[0]} --config {selection[1]} builds {preset}, not the model given")
        return preset
    if model is None:
        named = f"--module {selection[0]} --config {selection[1]}" if selection[0] else "no --module/--config"
        raise CommandLineError(f"torchtitan builds its model in Python ({named}), which resiplan cannot read: give the "
                               "model (a preset name or an architecture) beside the settings")
    if selection[0]:
        notes.append(f"the model is the one given: --module {selection[0]} --config {selection[1]} is not one "
                     "resiplan reads")
    return model


def _layers(model: str | dict) -> int:
    return int(model["num_layers"]) if isinstance(model, dict) else model_preset(model).num_layers


def _pipeline(options: dict, pp: int, model: str | dict, not_modelled: list[str], notes: list[str]) -> dict:
    """Schedule, virtual stages and layer split."""
    if pp == 1:
        return {"schedule": "1f1b", "virtual_stages": 1}
    named = (options.get("--parallelism.pipeline_parallel_schedule") or ["1F1B"])[0]
    parts = options.get("--parallelism.module_fqns_per_model_part")
    per_stage = _int(options, "--parallelism.pipeline_parallel_layers_per_stage", None)
    first_less = _int(options, "--parallelism.pipeline_parallel_first_stage_less_layers", 1)
    last_less = _int(options, "--parallelism.pipeline_parallel_last_stage_less_layers", 1)
    layers = _layers(model)
    counts, v = None, 1
    if parts:
        v = len(parts) // pp
        counts = [sum(1 for fqn in part.split(",") if fqn.startswith("layers.")) for part in parts]
    elif per_stage:
        parts_needed = -(-(layers + first_less + last_less) // per_stage)
        if parts_needed % pp:
            raise CommandLineError(f"pipeline_parallel_layers_per_stage {per_stage} cuts {layers} layers (+ {first_less} "
                                   f"+ {last_less} for the embedding and output) into {parts_needed} model parts, not a "
                                   f"multiple of pp {pp}; torchtitan refuses that")
        v = parts_needed // pp
        counts = _torchtitan_parts(layers, parts_needed, first_less, last_less)
    schedule = _SCHEDULES.get(named)
    if schedule is None:
        chunked = named not in ("PipelineScheduleSingle", "ZBVZeroBubble") and (v > 1 or named.startswith(
            ("Interleaved", "PipelineScheduleMulti")))
        schedule = "interleaved" if chunked else "1f1b"
        not_modelled.append(f"--parallelism.pipeline_parallel_schedule {named}: estimated as {schedule} (a CSV or "
                            "zero-bubble schedule is not read back by name)")
    if schedule in _CHUNKED and v == 1:
        v = 2
        notes.append(f"{named} without a layer count per model part: estimated with 2 model parts per stage")
    if counts is None:
        counts = _torchtitan_parts(layers, pp * v, first_less, last_less)
    out = {"schedule": schedule, "virtual_stages": v}
    if v > 1 and len(set(counts)) > 1:
        out["layers_per_chunk"] = counts  # part c x pp + s runs on stage s (torchtitan's looped placement)
    elif v == 1 and len(set(counts)) > 1:
        out["layers_per_stage"] = counts
    return out


def _torchtitan_parts(layers: int, parts: int, first_less: int, last_less: int) -> list[int]:
    """Transformer layers of each model part as torchtitan cuts them without module_fqns_per_model_part
    (torchtitan/distributed/pipeline_parallel.py, `_generate_llm_fqn_per_model_part`): the embedding weighs
    `first_less` layers and the output `last_less`, those effective layers split evenly over the parts (the
    first ones taking the remainder), and the first and last part then hold their weight fewer layers."""
    effective = layers + first_less + last_less
    base, extra = divmod(effective, parts)
    if parts > 1 and (base < 1 or max(first_less, last_less) > base):
        raise CommandLineError(f"{layers} layers cannot be cut into {parts} model parts with the embedding weighing "
                               f"{first_less} and the output {last_less} layers; torchtitan refuses that")
    counts = [base + (1 if part < extra else 0) for part in range(parts)]
    if parts == 1:
        return [layers]
    counts[0] -= first_less
    counts[-1] -= last_less
    return counts


def _recompute(mode: str | None, notes: list[str]) -> str:
    if mode is None:
        notes.append("no activation_checkpoint mode given: the config function's, estimated as selective")
        return "selective"
    if mode not in ("none", "selective", "full"):
        raise CommandLineError(f"activation_checkpoint:{mode}: torchtitan knows none, selective and full")
    return mode
