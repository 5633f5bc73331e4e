"""The model's architecture as Megatron command-line flags: Megatron-LM's and Megatron-DeepSpeed's.

Without these the trainer builds its defaults (Megatron-LM: LayerNorm, learned absolute positions,
biases everywhere, GELU), a different model from the one the plan laid out. Both spellings come from
the arguments.py of each project (Megatron-LM core_v0.16.1, which megatron-core 0.16 pairs with;
microsoft/Megatron-DeepSpeed's main branch):

    architecture                 Megatron-LM                                Megatron-DeepSpeed
    shape                        --num-layers --hidden-size --ffn-hidden-size --num-attention-heads
    GQA                          --group-query-attention --num-query-groups  --num-key-value-heads
    SwiGLU / untied              --swiglu / --untie-embeddings-and-output-weights (both)
    normalization                --normalization RMSNorm|LayerNorm           --normalization rmsnorm|layernorm
    epsilon                      --norm-epsilon                              --layernorm-epsilon
    RoPE                         --position-embedding-type rope              --use-rotary-position-embeddings
                                 --rotary-base (a whole number)              --no-position-embedding
                                 --rotary-percent                            --rotary-position-embeddings-theta
                                                                             --rotary-percent
    Llama 3.1 scaling            --use-rope-scaling                          (none: refused)
    learned positions            --position-embedding-type learned_absolute  (the default)
                                 --max-position-embeddings (the table)       --max-position-embeddings
    no biases                    --disable-bias-linear (both)
    Q, K, V biases only          --disable-bias-linear --add-qkv-bias        (none: refused)
    attention sinks              --softmax-type learnable                    (none: refused)
    sliding window W, every k    --window-size W-1,0 --window-attn-skip-freq k  (none: refused)
      layers full
    latent attention (MLA)       --multi-latent-attention --q-lora-rank      (none: refused)
                                 --kv-lora-rank --qk-head-dim --qk-pos-emb-head-dim --v-head-dim
                                 --qk-layernorm (the latents' RMSNorms)
                                 --rope-type rope|yarn --rotary-scaling-factor --mscale --mscale-all-dim
    first k layers dense         --moe-layer-freq "([0]*k+[1]*(L-k))"        (none: refused)
                                 --ffn-hidden-size (the dense width)
    multi-token prediction       --mtp-num-layers                            (none: refused)

Megatron-LM 0.16.1's gpt_builder passes `rope_scaling` to GPTModel but not `--rope-scaling-factor`,
so megatron-core's own factor 8 (and its low/high frequency factors 1 and 4 from a context of 8192)
is what runs: other Llama 3.x scalings (Llama 3.2's factor 32) are refused rather than run as 8.
With latent attention YaRN runs as MLATransformerConfig's: the factor and mscales from flags, the context it
starts from (4096) and the ramp (beta_fast 32, beta_slow 1) from its defaults, which have no flags; other values
are refused. DeepSeek-V3's routing (sigmoid scores, expert bias, grouped top-k: --moe-router-score-function,
--moe-router-enable-expert-bias, --moe-router-num-groups, ...) changes no weight and no cost and is left to the
recipe.
The vocabulary is the tokenizer's, padded by Megatron to a multiple of --make-vocab-size-divisible-by
(128) x tp; the plan counted `vocab_size` rows.
"""

from __future__ import annotations

from adapters.registry import ExportError
from wire.schemas import ModelArchitecture

# megatron-core's RotaryEmbedding._apply_scaling defaults, the only values Megatron-LM 0.16 runs
MEGATRON_ROPE_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}
# MLATransformerConfig's YaRN fields that Megatron-LM 0.16.1 has no flag for: the only values it runs
MEGATRON_MLA_YARN = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}


# Fields a plan records since it carries the model's details; a stored plan without them would get
# defaults (RoPE base 10000, RMSNorm) that are not necessarily its model's.
RECORDED_DETAILS = frozenset({"normalization", "norm_epsilon", "position_embedding", "rope_theta", "qkv_bias",
                              "linear_bias"})


def check_recorded(arch: ModelArchitecture, target: str) -> None:
    """ExportError when the plan predates architecture details: the flags would describe a guess."""
    missing = sorted(RECORDED_DETAILS - arch.model_fields_set)
    if missing:
        raise ExportError(f"{target} cannot be told this plan's model: it was stored before plans recorded "
                          f"{', '.join(missing)}; plan it again")


def _number(value: float) -> str:
    """A float as argparse's float() reads it back exactly."""
    return repr(float(value))


def _whole_theta(arch: ModelArchitecture, target: str) -> str:
    if not float(arch.rope_theta).is_integer():
        raise ExportError(f"{target} cannot build this model: its RoPE base {arch.rope_theta!r} is not a whole "
                          "number, and the rotary base flag takes an integer")
    return str(int(arch.rope_theta))


def _shape_args(arch: ModelArchitecture) -> list[str]:
    """The shape; --ffn-hidden-size is the dense layers' MLP where a mixture of experts has some (the experts'
    is --moe-ffn-hidden-size)."""
    return [
        "--num-layers", str(arch.num_layers),
        "--hidden-size", str(arch.hidden_size),
        "--ffn-hidden-size", str(arch.dense_ffn_hidden_size or arch.ffn_hidden_size),
        "--num-attention-heads", str(arch.num_attention_heads),
    ]


def _positions(arch: ModelArchitecture, seq_length: int) -> str:
    """--max-position-embeddings: the learned table's rows, else the sequence length (RoPE has no table)."""
    return str(arch.max_position_embeddings if arch.position_embedding == "learned" else seq_length)


def megatron_lm_model_args(arch: ModelArchitecture, seq_length: int, target: str = "Megatron-LM",
                           expert_parallel: int = 1, moe_dispatcher: str | None = None,
                           expert_tensor_parallel: int | None = None) -> list[str]:
    """Megatron-LM pretrain_gpt.py flags that build exactly `arch` (its experts split over `expert_parallel`
    GPUs, each over `expert_tensor_parallel`; None: TP); ExportError for what it cannot build."""
    check_recorded(arch, target)
    unexported = gpt_oss_features(arch)
    if unexported:
        raise ExportError(f"{target} cannot build this model as resiplan exports it: {', '.join(unexported)} "
                          "(Megatron-LM 0.16.1's pretrain_gpt.py has no flag for YaRN on a GPT model, and "
                          "resiplan does not emit biased experts); export to torchtitan, or plan the architecture "
                          "without them")
    args = _shape_args(arch)
    kv_heads = arch.num_kv_heads or arch.num_attention_heads
    if kv_heads != arch.num_attention_heads:
        args += ["--group-query-attention", "--num-query-groups", str(kv_heads)]
    if arch.kv_lora_rank:
        args += _latent_attention_args(arch, target)
    elif arch.head_dim is not None:
        args += ["--kv-channels", str(arch.head_dim)]
    if arch.qk_norm:
        args.append("--qk-layernorm")
    if arch.swiglu:
        args.append("--swiglu")
    if not arch.tied_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    args += ["--normalization", "RMSNorm" if arch.normalization == "rmsnorm" else "LayerNorm",
             "--norm-epsilon", _number(arch.norm_epsilon)]
    if arch.position_embedding == "rope":
        args += ["--position-embedding-type", "rope", "--rotary-base", _whole_theta(arch, target)]
        if arch.rotary_percent != 1.0:
            args += ["--rotary-percent", _number(arch.rotary_percent)]
        if arch.rope_scaling is not None and not arch.kv_lora_rank:
            scaling = arch.rope_scaling.model_dump(include=set(MEGATRON_ROPE_SCALING))
            if arch.rope_scaling.rope_type != "llama3" or scaling != MEGATRON_ROPE_SCALING:
                raise ExportError(
                    f"{target} cannot build this model: pretrain_gpt.py runs Llama 3.1 RoPE scaling only as "
                    f"megatron-core's {MEGATRON_ROPE_SCALING} (it does not pass --rope-scaling-factor on), "
                    f"the model's is {scaling}"
                )
            args += ["--use-rope-scaling", "--rope-scaling-factor", _number(scaling["factor"])]
    else:
        args += ["--position-embedding-type", "learned_absolute"]
    args += ["--max-position-embeddings", _positions(arch, seq_length)]
    if not arch.linear_bias:
        args.append("--disable-bias-linear")
        if arch.qkv_bias:
            args.append("--add-qkv-bias")
    # multi-token prediction: megatron-core's MultiTokenPredictionBlock, on the last pipeline stage
    mtp = ["--mtp-num-layers", str(arch.mtp_layers)] if arch.mtp_layers else []
    return args + _attention_variant_args(arch) + _expert_args(arch, expert_parallel, moe_dispatcher, expert_tensor_parallel) + mtp


def _latent_attention_args(arch: ModelArchitecture, target: str) -> list[str]:
    """Multi-head latent attention as megatron-core's MLASelfAttention builds it (the latents' norms with
    --qk-layernorm), its RoPE plain or YaRN (see the module docstring)."""
    args = ["--multi-latent-attention", "--kv-lora-rank", str(arch.kv_lora_rank), "--qk-head-dim", str(arch.head_dim),
            "--qk-pos-emb-head-dim", str(arch.qk_rope_head_dim), "--v-head-dim", str(arch.v_head_dim or arch.head_dim),
            "--qk-layernorm"]
    if arch.q_lora_rank:
        args += ["--q-lora-rank", str(arch.q_lora_rank)]
    scaling = arch.rope_scaling
    if scaling is None:
        return args + ["--rope-type", "rope"]
    fixed = scaling.model_dump(include=set(MEGATRON_MLA_YARN))
    if scaling.rope_type != "yarn" or fixed != MEGATRON_MLA_YARN:
        raise ExportError(f"{target} cannot build this model: its latent attention runs RoPE plain or as YaRN with "
                          f"{MEGATRON_MLA_YARN} (MLATransformerConfig's defaults, which have no flags); the model's "
                          f"scaling is {scaling.rope_type} with {fixed}")
    return args + ["--rope-type", "yarn", "--rotary-scaling-factor", _number(scaling.factor),
                   "--mscale", _number(1.0 if scaling.mscale is None else scaling.mscale),
                   "--mscale-all-dim", _number(scaling.mscale_all_dim or 0.0)]


def _attention_variant_args(arch: ModelArchitecture) -> list[str]:
    """Attention sinks as megatron-core's learnable softmax offset (one logit per head and layer), sliding windows
    as its window_size (left, 0): a query sees itself and `left` keys before it, so a window of W keys is W - 1
    (megatron/core/transformer/utils.py get_sliding_window_causal_mask); every k-th layer full as
    --window-attn-skip-freq k (is_layer_window_attention: 1-based layer numbers divisible by k are full, the last
    of each k as the plan's full_attention_every counts them)."""
    args = ["--softmax-type", "learnable"] if arch.attention_sinks else []
    if arch.sliding_window is not None:
        args += ["--window-size", f"{arch.sliding_window - 1},0"]
        if arch.full_attention_every:
            args += ["--window-attn-skip-freq", str(arch.full_attention_every)]
    return args


def gpt_oss_features(arch: ModelArchitecture) -> list[str]:
    """GPT-OSS's departures from a Llama/Mixtral-style decoder that `arch` has and the export cannot say: YaRN
    RoPE scaling, biased experts (its attention sinks and sliding windows it can: `_attention_variant_args`)."""
    found = []
    if arch.rope_scaling is not None and arch.rope_scaling.rope_type == "yarn" and not arch.kv_lora_rank:
        found.append("YaRN RoPE scaling")
    if arch.num_experts and arch.linear_bias:
        found.append("biases on the router and experts")
    return found


def _expert_args(arch: ModelArchitecture, expert_parallel: int, moe_dispatcher: str | None = None,
                 expert_tensor_parallel: int | None = None) -> list[str]:
    """A mixture of experts in every layer (but the first `dense_layers`), as the plan prices it: experts split
    over `expert_parallel` GPUs and each over `expert_tensor_parallel` (None: TP, megatron-core's default when
    --expert-tensor-parallel-size is unset, which is then left out)."""
    if not arch.num_experts:
        return []
    # The dispatcher the plan prices (`cost_models.expert_parallel`): the all-to-all, or the flex dispatcher over
    # DeepEP's kernels; megatron-core's default is its all-gather dispatcher, which gathers every token of the
    # EP x TP group on every GPU.
    dispatcher = ["flex", "--moe-flex-dispatcher-backend", "deepep"] if moe_dispatcher == "flex" else ["alltoall"]
    args = ["--num-experts", str(arch.num_experts), "--moe-router-topk", str(arch.experts_per_token),
            "--moe-ffn-hidden-size", str(arch.ffn_hidden_size), "--expert-model-parallel-size", str(expert_parallel),
            "--moe-token-dispatcher-type", *dispatcher]
    if expert_tensor_parallel is not None:
        args += ["--expert-tensor-parallel-size", str(expert_tensor_parallel)]
    if arch.shared_expert_ffn_hidden_size:
        args += ["--moe-shared-expert-intermediate-size", str(arch.shared_expert_ffn_hidden_size)]
    if arch.dense_layers:  # Megatron-LM's moe_freq_type pattern: 0 a dense layer, 1 an expert one
        args += ["--moe-layer-freq", f"([0]*{arch.dense_layers}+[1]*{arch.num_layers - arch.dense_layers})"]
    return args


def megatron_deepspeed_model_args(arch: ModelArchitecture, seq_length: int) -> list[str]:
    """Megatron-DeepSpeed pretrain_gpt.py flags that build exactly `arch`; ExportError for what it cannot."""
    target = "Megatron-DeepSpeed"
    check_recorded(arch, target)
    problems = []
    if arch.qkv_bias and not arch.linear_bias:
        problems.append("it has no Q, K, V-only biases (only --disable-bias-linear for all or none)")
    if arch.rope_scaling is not None:
        problems.append("it has no Llama 3.1 RoPE scaling")
    if arch.attention_sinks or arch.sliding_window is not None:
        problems.append("it has no attention sinks or sliding windows")
    if arch.mtp_layers:
        problems.append("it has no multi-token prediction")
    if arch.num_experts:
        problems.append("its mixture-of-experts layers: Megatron-DeepSpeed's MoE (deepspeed.moe.layer.MoE) drops "
                        "tokens over a capacity factor and replicates experts across TP ranks, which the plan does "
                        "not price; run a Hugging Face model under the config's expert_parallel section (DeepSpeed's "
                        "AutoEP), or export to Megatron-LM")
    if arch.head_dim is not None or arch.qk_norm:
        problems.append("its heads (head_dim apart from hidden / heads, latent attention, or query/key norms) are "
                        "not among Megatron-DeepSpeed's flags; export to Megatron-LM instead")
    if problems:
        raise ExportError(f"{target} cannot build this model: {'; '.join(problems)}")
    args = _shape_args(arch)
    kv_heads = arch.num_kv_heads or arch.num_attention_heads
    if kv_heads != arch.num_attention_heads:
        args += ["--num-key-value-heads", str(kv_heads)]
    if arch.swiglu:
        args.append("--swiglu")
    if not arch.tied_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    args += ["--normalization", arch.normalization, "--layernorm-epsilon", _number(arch.norm_epsilon)]
    if arch.position_embedding == "rope":
        args += ["--use-rotary-position-embeddings", "--no-position-embedding",
                 "--rotary-position-embeddings-theta", _whole_theta(arch, target)]
        if arch.rotary_percent != 1.0:
            args += ["--rotary-percent", _number(arch.rotary_percent)]
    args += ["--max-position-embeddings", _positions(arch, seq_length)]
    if not arch.linear_bias:
        args.append("--disable-bias-linear")
    return args
