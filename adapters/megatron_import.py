"""A Megatron-LM command line read back into a resiplan estimate request: the layout it runs, the model it
builds and the batch it trains, with every flag that changes time or memory either mapped or reported as
not modelled, and nothing dropped silently.

The mapping is the export's (`adapters.megatron`, `adapters.megatron_model`) read backwards, with the
defaults of Megatron-LM's arguments.py (core_v0.16.1) where a flag is absent: LayerNorm, learned absolute
positions, biases on, GELU, tied embeddings, no recompute, no distributed optimizer, fp32 unless --bf16 or
--fp16 (resiplan plans bf16 or fp16 only: fp32 is refused).

    flags                                              request
    --tensor-model-parallel-size, --pipeline-...      layout.tp, layout.pp
    --context-parallel-size                           layout.cp
    --expert-model-parallel-size                      layout.ep
    --expert-tensor-parallel-size                     layout.etp (when not tp)
    --overlap-moe-expert-parallel-comm                training.moe_a2a_overlap
    --tp-comm-overlap                                 training.tp_comm_overlap megatron
    --attention-backend fused / auto                  training.attention_kernel fused (flash, unfused and local are
                                                      reported: FlashAttention-2 or -3, or scores materialized)
    --num-virtual-stages-per-pipeline-rank v,          layout.virtual_stages, schedule interleaved
      --num-layers-per-virtual-pipeline-stage n
    --decoder-first/last-pipeline-num-layers,          layout.layers_per_stage; layout.layers_per_chunk where a
      --pipeline-model-parallel-layout,                stage's model chunks differ
      --account-for-embedding/loss-in-pipeline-split
    --micro-batch-size, --global-batch-size,           layout.micro_batch_size, training.global_batch_size,
      --seq-length                                       training.seq_length
    --recompute-granularity / -method / -num-layers    layout.recompute (selective; full = uniform, 1 layer)
    --use-distributed-optimizer                        training.zero_stage 1 (else 0)
    --use-megatron-fsdp --data-parallel-sharding-strategy  training.zero_stage 0-3 (no_shard, optim, optim_grads,
                                                       optim_grads_params; Megatron-LM's default the last)
    --num-distributed-optimizer-instances n            layout.dp_shard = dp / n (hybrid sharding; dp from the
                                                       launcher's ranks)
    --overlap-grad-reduce, --overlap-param-gather      what the cost model assumes (their absence is reported)
    --bf16 / --fp16                                    training.precision
    --grad-reduce-in-bf16                              training.grad_precision bf16 (--accumulate-allreduce-
                                                       grads-in-fp32, the bf16 default, fp32)
    model shape, GQA, --swiglu, untied embeddings,     model (an architecture object)
      normalization, RoPE or learned positions,
      biases, --vocab-size, --kv-channels (head_dim),
      --qk-layernorm, --softmax-type learnable (attention
      sinks), --window-size, --window-attn-skip-freq,
      --num-experts, --moe-router-topk,
      --moe-ffn-hidden-size, --moe-shared-expert-
      intermediate-size, --moe-layer-freq
      "([0]*k+[1]*(L-k))" (dense_layers k, read
      without evaluating it), --multi-latent-attention
      and its widths, --rope-type, --rotary-scaling-
      factor, --mscale, --mscale-all-dim

Megatron takes the vocabulary from its tokenizer: without --vocab-size the importer needs `vocab_size`, or
a model preset of the same shape whose vocabulary it then takes (and says so).
"""

from __future__ import annotations

import math
import re

from adapters.command_line import CommandLineError, Imported, command_words, world_size
from adapters.megatron import FSDP_SHARDING
from cost_models.expert_parallel import a2a_overlap_applies
from cost_models.model_spec import model_preset, model_preset_names


# Flags that change neither time nor memory of an iteration: read and set aside, by prefix.
_NO_EFFECT_PREFIXES = (
    "--lr", "--min-lr", "--decoupled-lr", "--decoupled-min-lr", "--lr-", "--weight-decay", "--adam-", "--clip-grad",
    "--init-method-std", "--seed", "--train-iters", "--train-samples", "--eval-", "--log-", "--save", "--load",
    "--tensorboard-", "--wandb-", "--data-", "--split", "--tokenizer-", "--mock-data", "--tiktoken-", "--vocab-file",
    "--merge-file", "--num-workers", "--exit-", "--distributed-timeout-minutes", "--ckpt-", "--profile",
    "--no-mmap-bin-files", "--no-create-attention-mask-in-dataloader", "--use-mcore-models", "--use-checkpoint-",
    "--attention-dropout", "--hidden-dropout", "--use-tp-pp-dp-mapping", "--microbatch-group-size-per-virtual-",
    "--timing-log-", "--no-load-", "--finetune", "--dataloader-type", "--reset-", "--eod-mask-loss", "--rampup-",
    # FP8 scaling settings: numerics, not time or memory
    "--fp8-amax-", "--fp8-margin", "--fp8-interval", "--fp8-recipe",
)
# Flags whose value is a separate word (every other flag of the table below is a switch).
_SWITCHES = frozenset({
    "--multi-latent-attention", "--group-query-attention", "--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--add-qkv-bias", "--use-rope-scaling", "--use-distributed-optimizer", "--bf16", "--fp16",
    "--sequence-parallel", "--overlap-grad-reduce", "--overlap-param-gather", "--use-mcore-models", "--mock-data",
    "--no-mmap-bin-files", "--no-create-attention-mask-in-dataloader", "--use-tp-pp-dp-mapping", "--profile",
    "--log-throughput", "--apply-layernorm-1p", "--manual-gc", "--cross-entropy-loss-fusion",
    "--calculate-per-token-loss", "--grad-reduce-in-bf16", "--fp8-param-gather", "--use-flash-attn",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion", "--no-rope-fusion", "--tp-comm-overlap", "--finetune", "--eod-mask-loss",
    "--no-load-optim", "--no-load-rng", "--use-checkpoint-args", "--reset-position-ids", "--reset-attention-mask",
    "--no-position-embedding", "--fp16-lm-cross-entropy", "--accumulate-allreduce-grads-in-fp32",
    "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute",
})
def _flags(words: list[str]) -> tuple[dict[str, str | None], list[str]]:
    """flag -> value (None for a switch), and the words that are not flags or values."""
    flags: dict[str, str | None] = {}
    stray = []
    i = 0
    while i < len(words):
        word = words[i]
        if not word.startswith("--"):
            stray.append(word)
            i += 1
            continue
        takes_value = word not in _SWITCHES and i + 1 < len(words) and not words[i + 1].startswith("--")
        flags[word] = words[i + 1] if takes_value else None
        i += 2 if takes_value else 1
    return flags, stray


def _number(flags: dict, name: str, default, kind: type = int):
    """`name`'s value read as `kind` (int or float), `default` when the flag is absent."""
    value = flags.get(name)
    if value is None:
        return default
    try:
        return kind(value)
    except ValueError:
        raise CommandLineError(f"{name} {value!r} is not a {'whole number' if kind is int else 'number'}") from None


# Sizes, counts and parallel degrees Megatron needs at least one of; every other whole-number flag at least 0.
_AT_LEAST_ONE = frozenset({
    "--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--global-batch-size",
    "--micro-batch-size", "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
    "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--num-virtual-stages-per-pipeline-rank",
    "--num-layers-per-virtual-pipeline-stage", "--num-query-groups", "--kv-channels", "--ffn-hidden-size",
    "--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size", "--num-distributed-optimizer-instances",
    "--vocab-size", "--max-position-embeddings",
})


def _int(flags: dict, name: str, default: int | None = None) -> int | None:
    value = _number(flags, name, default)
    least = 1 if name in _AT_LEAST_ONE else 0
    if flags.get(name) is not None and value < least:
        raise CommandLineError(f"{name} {value} must be at least {least}")
    return value


def _float(flags: dict, name: str, default: float, least: float | None = None) -> float:
    """A finite number above 0 (at least `least` where given): epsilons, rotary bases, scaling factors."""
    value = _number(flags, name, default, float)
    if not math.isfinite(value) or (value < least if least is not None else value <= 0):
        raise CommandLineError(f"{name} {flags.get(name)} must be a finite number "
                               + (f"of at least {least:g}" if least is not None else "above 0"))
    return value


def _required(flags: dict, name: str) -> int:
    value = _int(flags, name)
    if value is None:
        raise CommandLineError(f"the command line has no {name}: resiplan cannot estimate a job without it")
    return value


def _chunks_from_layout(text: str, pp: int) -> list[int]:
    """Layers of each virtual stage (chunk c of stage s at c x pp + s) from --pipeline-model-parallel-layout
    ("Et*3|t*5|...|tL": one entry per virtual stage, E the embedding, L the loss)."""
    entries = text.split("|")
    if len(entries) % pp:
        raise CommandLineError(f"--pipeline-model-parallel-layout has {len(entries)} entries, not a multiple of pp {pp}")
    chunks = []
    for entry in entries:
        body = entry.replace("E", "").replace("L", "")
        layers = 0
        for run in re.findall(r"t(?:\*(\d+))?", body):
            layers += int(run) if run else 1
        if body.replace("t", "").replace("*", "").strip("0123456789"):
            raise CommandLineError(f"--pipeline-model-parallel-layout entry {entry!r} holds more than transformer layers")
        chunks.append(layers)
    return chunks


def _chunks_counting_ends(flags: dict, layers: int, pp: int, v: int) -> list[int]:
    """megatron-core's split under --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split:
    the embedding and the loss each take a layer's slot, the slots cut evenly over the pp x v virtual stages."""
    embedding, loss = ("--account-for-embedding-in-pipeline-split" in flags,
                       "--account-for-loss-in-pipeline-split" in flags)
    slots = layers + embedding + loss
    if slots % (pp * v):
        raise CommandLineError(f"{layers} layers{' + the embedding' if embedding else ''}{' + the loss' if loss else ''} "
                               f"= {slots} slots do not split evenly over pp {pp} x {v} virtual stages")
    chunks = [slots // (pp * v)] * (pp * v)
    chunks[0] -= embedding
    chunks[-1] -= loss
    if min(chunks) < 1:
        raise CommandLineError("counting the embedding and the loss as layers leaves a virtual stage without a "
                               "transformer layer, which resiplan does not estimate")
    return chunks


# Flags that change time or memory in ways the cost model does not represent, and why; a flag at the value
# that changes nothing (context parallelism 1) is not reported.
_NOT_MODELLED = {
    "--fp8-param-gather": "FP8 primary weights (all-gathered in FP8, no bf16 copy) are not in the cost model: "
                          "priced with bf16 weights and FP8 copies",
    "--delay-wgrad-compute": "delaying weight gradients to widen the EP overlap is not modelled: estimated without it",
    "--cpu-offloading": "CPU offloading is not in the cost model",
    "--apply-layernorm-1p": "a LayerNorm variant: timed as LayerNorm",
    "--cross-entropy-loss-fusion": "a fused loss kernel: its speed is not modelled",
    "--empty-unused-memory-level": "the allocator's cache emptying is not modelled",
    "--manual-gc": "Python's garbage-collection pauses are not modelled",
    "--calculate-per-token-loss": "the loss reduction's cost is not modelled",
}
_HARMLESS_VALUES = {"--empty-unused-memory-level": "0"}


def _not_modelled(flags: dict) -> list[str]:
    out = []
    for name, why in _NOT_MODELLED.items():
        if name in flags and flags[name] != _HARMLESS_VALUES.get(name, object()):
            value = flags[name]
            out.append(f"{name}{'' if value is None else ' ' + value}: {why}")
    return out


def import_megatron(text: str, vocab_size: int | None = None) -> Imported:
    """The estimate request (less its cluster) a Megatron-LM pretrain_gpt.py command line describes."""
    launcher, words = command_words(text)
    flags, stray = _flags(words)
    notes: list[str] = []
    layers = _required(flags, "--num-layers")
    heads = _required(flags, "--num-attention-heads")
    hidden = _required(flags, "--hidden-size")
    ffn = _int(flags, "--ffn-hidden-size", 4 * hidden)
    kv_heads = _int(flags, "--num-query-groups", heads) if "--group-query-attention" in flags else heads
    kv_channels = _int(flags, "--kv-channels", hidden // heads)
    not_modelled = _not_modelled(flags)
    arch: dict = {"num_layers": layers, "hidden_size": hidden, "ffn_hidden_size": ffn, "num_attention_heads": heads,
                  "num_kv_heads": kv_heads, "swiglu": "--swiglu" in flags,
                  "tied_embeddings": "--untie-embeddings-and-output-weights" not in flags}
    if kv_channels * heads != hidden:
        arch["head_dim"] = kv_channels
    if "--qk-layernorm" in flags:
        arch["qk_norm"] = True
    experts = _int(flags, "--num-experts")
    if experts is not None:
        # every layer a mixture of experts (megatron-core's default --moe-layer-freq 1), experts as wide as
        # --moe-ffn-hidden-size (default --ffn-hidden-size), the router's top-k default 2
        arch.update(num_experts=experts, experts_per_token=_int(flags, "--moe-router-topk", 2),
                    ffn_hidden_size=_int(flags, "--moe-ffn-hidden-size", ffn),
                    shared_expert_ffn_hidden_size=_int(flags, "--moe-shared-expert-intermediate-size", 0))
    _dense_first_layers(flags, arch, ffn, not_modelled)
    normalization = (flags.get("--normalization") or "LayerNorm").lower()
    if normalization not in ("layernorm", "rmsnorm"):
        raise CommandLineError(f"--normalization {flags['--normalization']}: resiplan models LayerNorm and RMSNorm")
    arch["normalization"] = normalization
    arch["norm_epsilon"] = _float(flags, "--norm-epsilon", 1e-5)
    positions = flags.get("--position-embedding-type") or "learned_absolute"
    seq_length = _required(flags, "--seq-length")
    if positions == "rope":
        arch["position_embedding"] = "rope"
        arch["rope_theta"] = _float(flags, "--rotary-base", 10000.0)
        arch["rotary_percent"] = _float(flags, "--rotary-percent", 1.0)
        if "--use-rope-scaling" in flags:
            arch["rope_scaling"] = {"factor": _float(flags, "--rope-scaling-factor", 8.0), "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    elif positions == "learned_absolute":
        arch["position_embedding"] = "learned"
        arch["max_position_embeddings"] = _int(flags, "--max-position-embeddings", seq_length)
    else:
        raise CommandLineError(f"--position-embedding-type {positions}: resiplan models rope and learned_absolute")
    _latent_attention(flags, arch, notes)
    if _int(flags, "--mtp-num-layers", 0):
        arch["mtp_layers"] = _int(flags, "--mtp-num-layers", 0)
    arch["linear_bias"] = "--disable-bias-linear" not in flags
    arch["qkv_bias"] = not arch["linear_bias"] and "--add-qkv-bias" in flags
    arch.update(_attention_variant(flags, layers, not_modelled))
    arch["vocab_size"] = _vocab(flags, arch, vocab_size, notes)

    tp = _int(flags, "--tensor-model-parallel-size", 1)
    pp = _int(flags, "--pipeline-model-parallel-size", 1)
    layout: dict = {"tp": tp, "pp": pp, "micro_batch_size": _int(flags, "--micro-batch-size", 1)}
    cp = _int(flags, "--context-parallel-size", 1)
    if cp != 1:
        layout["cp"] = cp
    ep = _int(flags, "--expert-model-parallel-size", 1)
    if ep != 1:
        layout["ep"] = ep
    etp = _int(flags, "--expert-tensor-parallel-size", tp)
    if etp != tp:
        layout["etp"] = etp
    v = _int(flags, "--num-virtual-stages-per-pipeline-rank", 1)
    per_virtual = _int(flags, "--num-layers-per-virtual-pipeline-stage")
    if per_virtual is not None:
        if layers % (pp * per_virtual):
            raise CommandLineError(f"--num-layers-per-virtual-pipeline-stage {per_virtual}: {layers} layers do not "
                                   f"split into pp {pp} x chunks of {per_virtual} layers")
        v = layers // (pp * per_virtual)
    split, chunks = None, None
    if "--pipeline-model-parallel-layout" in flags:
        chunks = _chunks_from_layout(flags["--pipeline-model-parallel-layout"], pp)
        v = len(chunks) // pp
        split = [sum(chunks[s::pp]) for s in range(pp)]
    elif "--account-for-embedding-in-pipeline-split" in flags or "--account-for-loss-in-pipeline-split" in flags:
        chunks = _chunks_counting_ends(flags, layers, pp, v)
        split = [sum(chunks[s::pp]) for s in range(pp)]
    elif "--decoder-first-pipeline-num-layers" in flags or "--decoder-last-pipeline-num-layers" in flags:
        first = _int(flags, "--decoder-first-pipeline-num-layers")
        last = _int(flags, "--decoder-last-pipeline-num-layers")
        middle_stages = pp - (first is not None) - (last is not None)
        rest = layers - (first or 0) - (last or 0)
        if middle_stages < 0 or (middle_stages and rest % middle_stages) or (not middle_stages and rest):
            raise CommandLineError(f"--decoder-first/last-pipeline-num-layers leave {rest} layers for {middle_stages} "
                               "middle stages: they do not split evenly")
        middle = [rest // middle_stages] * middle_stages if middle_stages else []
        split = ([first] if first is not None else []) + middle + ([last] if last is not None else [])
    if v > 1 and chunks is None and split is not None and len(set(split)) > 1:
        chunks = [split[part % pp] // v for part in range(pp * v)]  # megatron-core cuts each stage evenly
    if v > 1 and chunks is not None and len(set(chunks)) > 1:
        layout["layers_per_chunk"] = chunks  # an interleaved estimate takes uneven chunks as chunks
    elif split is not None and len(set(split)) > 1:
        layout["layers_per_stage"] = split
    layout["virtual_stages"] = v
    layout["schedule"] = "interleaved" if v > 1 else "1f1b"
    layout["recompute"] = _recompute(flags, not_modelled)
    world = world_size(launcher)
    if world is not None:
        cp_text = f" x cp {cp}" if cp != 1 else ""
        if world % (tp * cp * pp):
            raise CommandLineError(f"torchrun starts {world} ranks, not a multiple of tp {tp}{cp_text} x pp {pp}")
        layout["dp"] = world // (tp * cp * pp)
    _hybrid_sharding(flags, layout, not_modelled)
    training = {"global_batch_size": _required(flags, "--global-batch-size"), "seq_length": seq_length,
                "zero_stage": _zero_stage(flags),
                "precision": _precision(flags)}
    _attention_backend(flags, not_modelled)
    if experts is not None:
        _dispatcher(flags, training, not_modelled)
        if "--overlap-moe-expert-parallel-comm" in flags:
            training["moe_a2a_overlap"] = True
            if not a2a_overlap_applies(ep, pp, layout["virtual_stages"], layout["recompute"]):
                not_modelled.append("--overlap-moe-expert-parallel-comm: megatron-core runs it only with expert "
                                    "parallelism, without full recompute, on one pipeline stage or an interleaved "
                                    "pipeline (its TransformerConfig refuses this command); estimated with the "
                                    "all-to-alls exposed")
    if "--tp-comm-overlap" in flags:
        # validate_args asserts sequence parallelism with it; it prices only where there is TP to overlap
        training["tp_comm_overlap"] = "megatron"
    if "--grad-reduce-in-bf16" in flags and training["precision"] != "fp16":
        training["grad_precision"] = "bf16"  # arguments.py: it turns accumulate_allreduce_grads_in_fp32 off
    ignored = sorted(name for name in flags if name.startswith(_NO_EFFECT_PREFIXES))
    known = {
        "--num-layers", "--num-attention-heads", "--hidden-size", "--ffn-hidden-size", "--group-query-attention",
        "--num-query-groups", "--kv-channels", "--qk-layernorm", "--num-experts", "--moe-router-topk",
        "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size", "--expert-model-parallel-size", "--swiglu", "--untie-embeddings-and-output-weights", "--normalization",
        "--norm-epsilon", "--position-embedding-type", "--rotary-base", "--rotary-percent", "--use-rope-scaling",
        "--rope-scaling-factor", "--max-position-embeddings", "--disable-bias-linear", "--add-qkv-bias",
        "--vocab-size", "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
        "--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage",
        "--pipeline-model-parallel-layout", "--decoder-first-pipeline-num-layers",
        "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
        "--decoder-last-pipeline-num-layers", "--micro-batch-size", "--global-batch-size", "--seq-length",
        "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--use-distributed-optimizer",
        "--bf16", "--fp16", "--fp8-format", "--sequence-parallel", "--overlap-grad-reduce", "--overlap-param-gather",
        "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "--ckpt-format", "--num-distributed-optimizer-instances",
        "--outer-dp-sharding-strategy", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32",
        "--softmax-type", "--window-size", "--window-attn-skip-freq", "--moe-layer-freq", *_LATENT_FLAGS,
        "--moe-token-dispatcher-type", "--moe-flex-dispatcher-backend", "--mtp-num-layers",
        "--expert-tensor-parallel-size", "--overlap-moe-expert-parallel-comm", "--attention-backend",
        "--tp-comm-overlap", *_NOT_MODELLED,
    }
    for name in sorted(flags):
        if name not in known and name not in ignored:
            value = flags[name]
            not_modelled.append(f"{name}{'' if value is None else ' ' + value}: not a flag resiplan knows; "
                                "its effect on time and memory is not modelled")
    if "--sequence-parallel" not in flags and tp > 1:
        not_modelled.append("no --sequence-parallel with tp > 1: the model assumes sequence parallelism")
    if "--overlap-grad-reduce" not in flags:
        not_modelled.append("no --overlap-grad-reduce: the model overlaps the gradient reduction with the backward")
    if ("--use-distributed-optimizer" in flags or "--use-megatron-fsdp" in flags) and "--overlap-param-gather" not in flags:
        not_modelled.append("no --overlap-param-gather: the model overlaps the weight all-gather with the next "
                            "forward")
    if stray:
        notes.append(f"words that are not flags, left out: {' '.join(stray[:8])}")
    request = {"model": arch, "training": training, "layout": layout}
    return Imported(request=request, not_modelled=not_modelled, ignored=ignored, notes=notes)


def _hybrid_sharding(flags: dict, layout: dict, not_modelled: list[str]) -> None:
    """layout.dp_shard from --num-distributed-optimizer-instances: dp / instances consecutive replicas shard
    the state, replicated across instances (Megatron-FSDP: with --outer-dp-sharding-strategy no_shard)."""
    instances = _int(flags, "--num-distributed-optimizer-instances") or 1
    outer = flags.get("--outer-dp-sharding-strategy") or "no_shard"
    if instances < 1:
        raise CommandLineError(f"--num-distributed-optimizer-instances {instances} is not a count (1 or more)")
    if outer != "no_shard" and instances > 1:
        not_modelled.append(f"--outer-dp-sharding-strategy {outer}: sharding across the instances too is not in the "
                            "cost model; estimated as replicated across them (no_shard)")
    if instances == 1:
        return
    if "--use-distributed-optimizer" not in flags and "--use-megatron-fsdp" not in flags:
        not_modelled.append(f"--num-distributed-optimizer-instances {instances} without a distributed optimizer: "
                            "nothing is sharded; estimated as replicated")
        return
    dp = layout.get("dp")
    if dp is None:
        not_modelled.append(f"--num-distributed-optimizer-instances {instances}: without a launcher's rank count the "
                            "replica count is unknown; estimated as sharding over every replica")
        return
    if dp % instances:
        raise CommandLineError(f"--num-distributed-optimizer-instances {instances} must divide the {dp} data-parallel "
                               "replicas (megatron-core asserts it)")
    layout["dp_shard"] = dp // instances


# Megatron-LM's latent attention flags (_add_mla_args, and --multi-latent-attention from MLATransformerConfig)
_LATENT_FLAGS = ("--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
                 "--v-head-dim", "--rope-type", "--rotary-scaling-factor", "--mscale", "--mscale-all-dim")


def _latent_attention(flags: dict, arch: dict, notes: list[str]) -> None:
    """--multi-latent-attention with its widths (arguments.py's defaults where absent) and its RoPE: YaRN unless
    --rope-type rope (MLATransformerConfig's default), from a context of 4096 with beta_fast 32 and beta_slow 1
    (its defaults, which have no flags); the export's `_latent_attention_args` read back."""
    if "--multi-latent-attention" not in flags:
        return
    if arch.get("position_embedding") != "rope":
        raise CommandLineError("--multi-latent-attention without --position-embedding-type rope: resiplan models "
                               "latent attention with rotary positions only")
    arch.update(kv_lora_rank=_int(flags, "--kv-lora-rank", 32), q_lora_rank=_int(flags, "--q-lora-rank", 0),
                head_dim=_int(flags, "--qk-head-dim", 128), qk_rope_head_dim=_int(flags, "--qk-pos-emb-head-dim", 64),
                v_head_dim=_int(flags, "--v-head-dim", 128))
    if not arch.pop("qk_norm", False):  # --qk-layernorm builds the latents' norms, which the model always has
        notes.append("no --qk-layernorm: Megatron builds the latents without their RMSNorms; estimated with them "
                     "(q_lora_rank + kv_lora_rank weights a layer)")
    if (flags.get("--rope-type") or "yarn") == "yarn":
        arch["rope_scaling"] = {"rope_type": "yarn", "factor": _float(flags, "--rotary-scaling-factor", 1.0),
                                "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                                "mscale": _float(flags, "--mscale", 1.0),
                                "mscale_all_dim": _float(flags, "--mscale-all-dim", 0.0, least=0.0)}


# What the token dispatchers other than the all-to-all the cost model prices do instead.
_DISPATCHERS = {
    "allgather": "gathers every token of the EP x TP group on every GPU (megatron-core's default)",
}


# megatron-core's --attention-backend values beside fused and auto (Transformer Engine's cuDNN attention, priced as
# training.attention_kernel "fused"), and why each is not that.
_ATTENTION_BACKENDS = {
    "flash": "Transformer Engine's FlashAttention backend runs FlashAttention-3 where flash_attn_3 is installed "
             "(priced: fused) and FlashAttention-2 otherwise, 1.6x the attention time on Hopper: set "
             'training.attention_kernel "fa2" for that',
    "unfused": "attention with its s x s scores materialized is not a request field: estimated with a fused kernel, "
               "faster and with less memory than it runs",
    "local": "megatron-core's own attention, its s x s scores materialized, is not a request field: estimated with a "
             "fused kernel, faster and with less memory than it runs",
}


def _attention_backend(flags: dict, not_modelled: list[str]) -> None:
    """--attention-backend: fused and auto are what the request's default attention_kernel prices."""
    backend = flags.get("--attention-backend")
    if backend is None or backend in ("fused", "auto"):
        return
    why = _ATTENTION_BACKENDS.get(backend, "not a backend megatron-core knows; estimated with a fused kernel")
    not_modelled.append(f"--attention-backend {backend}: {why}")


def _dispatcher(flags: dict, training: dict, not_modelled: list[str]) -> None:
    """--moe-token-dispatcher-type: the all-to-all and the flex dispatcher (training.moe_dispatcher) are priced;
    the all-gather, megatron-core's default, is reported."""
    dispatcher = flags.get("--moe-token-dispatcher-type") or "allgather"
    if dispatcher == "flex":
        training["moe_dispatcher"] = "flex"
    elif dispatcher != "alltoall":
        why = _DISPATCHERS.get(dispatcher, "a dispatcher resiplan does not know")
        not_modelled.append(f"--moe-token-dispatcher-type {dispatcher}: {why}; priced as the all-to-all dispatcher")


def _dense_first_layers(flags: dict, arch: dict, ffn: int, not_modelled: list[str]) -> None:
    """--moe-layer-freq "([0]*k+[1]*(L-k))", the export's pattern: the first k layers dense, --ffn-hidden-size
    wide. Read without evaluating it (Megatron-LM evals the expression); other patterns are reported."""
    freq = flags.get("--moe-layer-freq")
    if freq is None or freq.strip() == "1":
        return
    layers = arch["num_layers"]
    found = re.fullmatch(r"\(?\[0\]\*(\d{1,4})\+\[1\]\*(\d{1,4})\)?", freq.replace(" ", ""))
    if found and "num_experts" in arch and int(found[1]) + int(found[2]) == layers and 1 <= int(found[1]) < layers:
        arch.update(dense_layers=int(found[1]), dense_ffn_hidden_size=ffn)
        return
    not_modelled.append(f"--moe-layer-freq {freq}: of the patterns of dense and expert layers only the first layers "
                        "dense (\"([0]*k+[1]*(L-k))\") is in the cost model; every layer priced as MoE")


def _attention_variant(flags: dict, layers: int, not_modelled: list[str]) -> dict:
    """Attention sinks (--softmax-type learnable) and sliding windows (--window-size left,0: left + 1 keys, every
    k-th layer full with --window-attn-skip-freq k), the export's `_attention_variant_args` read back."""
    out: dict = {}
    softmax = flags.get("--softmax-type") or "vanilla"
    if softmax == "learnable":
        out["attention_sinks"] = True
    elif softmax != "vanilla":
        not_modelled.append(f"--softmax-type {softmax}: only megatron-core's learnable offset (attention sinks) is "
                            "in the cost model; estimated as plain softmax")
    window = flags.get("--window-size")
    if window is None:
        return out
    try:
        left, right = (int(part) for part in window.strip("()").split(","))
    except ValueError:
        raise CommandLineError(f"--window-size {window}: expected two whole numbers, left,right") from None
    if right != 0 or left < 0:
        not_modelled.append(f"--window-size {window}: only causal windows (left,0) are in the cost model; estimated "
                            "with full attention")
        return out
    out["sliding_window"] = left + 1
    skip = flags.get("--window-attn-skip-freq")
    if skip is None:
        out["full_attention_every"] = 0  # megatron-core: every layer windowed
    elif skip.strip().isdigit() and int(skip) >= 1:
        out["full_attention_every"] = int(skip)
    else:
        out["full_attention_every"] = 0
        not_modelled.append(f"--window-attn-skip-freq {skip}: a layer pattern is not in the cost model; estimated with "
                            f"every one of the {layers} layers windowed")
    return out


# What an architecture without experts or a head width of its own holds.
_DENSE_DEFAULTS = {"num_experts": 0, "experts_per_token": 0, "head_dim": None}


def _vocab(flags: dict, arch: dict, vocab_size: int | None, notes: list[str]) -> int:
    given = _int(flags, "--vocab-size")
    if given is not None:
        if vocab_size is not None and vocab_size != given:
            raise CommandLineError(f"--vocab-size {given} vs vocab_size {vocab_size}: give it once, or make them agree")
        return given
    if vocab_size is not None:
        return vocab_size
    shape = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_kv_heads", "num_experts",
             "experts_per_token", "head_dim")
    for name in model_preset_names():
        preset = model_preset(name)
        if all(getattr(preset, key) == arch.get(key, _DENSE_DEFAULTS.get(key)) for key in shape):
            notes.append(f"the vocabulary is preset {name}'s ({preset.vocab_size}), the preset of the same shape: "
                         "Megatron reads it from the tokenizer, which the command line names but resiplan cannot open")
            return preset.vocab_size
    raise CommandLineError("Megatron reads the vocabulary from its tokenizer, and no model preset has this shape: give "
                       "--vocab-size in the command line or vocab_size beside it")


def _recompute(flags: dict, not_modelled: list[str]) -> str:
    granularity = flags.get("--recompute-granularity")
    if granularity is None:
        return "none"
    if granularity == "selective":
        return "selective"
    if granularity != "full":
        raise CommandLineError(f"--recompute-granularity {granularity}: Megatron knows full and selective")
    method, count = flags.get("--recompute-method"), _int(flags, "--recompute-num-layers", 1)
    if (method, count) != ("uniform", 1):
        not_modelled.append(f"--recompute-method {method} --recompute-num-layers {count}: recompute is modelled as "
                            "every layer recomputed on its own (uniform, 1)")
    return "full"


# Megatron-FSDP's sharding strategies by ZeRO stage (megatron_fsdp.fully_shard.ShardingStrategy).
_FSDP_STAGES = {"no_shard": 0, "optim": 1, **{name: stage for stage, name in FSDP_SHARDING.items()}}


def _zero_stage(flags: dict) -> int:
    if "--use-megatron-fsdp" in flags:
        strategy = flags.get("--data-parallel-sharding-strategy") or "optim_grads_params"
        if strategy not in _FSDP_STAGES:
            raise CommandLineError(f"--data-parallel-sharding-strategy {strategy}: Megatron-FSDP's strategies are "
                                   f"{', '.join(_FSDP_STAGES)}")
        return _FSDP_STAGES[strategy]
    return 1 if "--use-distributed-optimizer" in flags else 0


def _precision(flags: dict) -> str:
    if "--bf16" in flags and "--fp16" in flags:
        raise CommandLineError("--bf16 and --fp16 both given: Megatron refuses that too")
    if "--fp8-format" in flags:
        # Transformer Engine's FP8 linears over bf16 or fp16 training; either format (e4m3, hybrid) is one price
        if "--fp16" in flags:
            raise CommandLineError("--fp8-format with --fp16: resiplan models FP8 over bf16 training only")
        return "fp8"
    if "--bf16" in flags:
        return "bf16"
    if "--fp16" in flags:
        return "fp16"
    raise CommandLineError("neither --bf16 nor --fp16: Megatron would train in fp32, which resiplan does not model")
