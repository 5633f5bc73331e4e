"""Architectures read out of a Hugging Face config.json, as-is, within the architecture limits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cost_models.model_spec import (
    ARCHITECTURE_LIMITS,
    LAYERNORM,
    LEARNED,
    LLAMA3_ROPE,
    MAX_MODEL_NAME_CHARS,
    MAX_ROPE_THETA,
    RMSNORM,
    YARN_ROPE,
    ModelSpec,
    RopeScaling,
)


class HfConfigError(ValueError):
    """A Hugging Face config.json lacks a field resiplan needs, or describes a model it cannot plan."""


_HF_ALIASES: dict[str, tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_attention_heads": ("num_attention_heads", "n_head"),
}

# Mixture-of-experts configs name their expert counts in one of these (Mixtral, DeepSeek, Qwen-MoE,
# OLMoE, DBRX, Jamba, ...). A model with experts planned as dense gets memory and time far off, so a config
# naming experts is read only by a family whose layout resiplan knows (_MOE_FAMILIES), and refused otherwise.
_EXPERT_COUNT_KEYS = ("num_local_experts", "n_routed_experts", "num_experts", "moe_num_experts", "expert_count",
                      "num_experts_per_tok")
_EXPERT_KEYS = (*_EXPERT_COUNT_KEYS, "n_shared_experts", "num_shared_experts", "moe_intermediate_size",
                "shared_expert_intermediate_size")


@dataclass(frozen=True)
class _MoeFamily:
    """Where one family's config.json keeps its experts. Every layer holds a mixture of experts, each expert a
    gated MLP (gate, up and down projections)."""

    count_keys: tuple[str, ...]  # routed experts per layer (the first present wins; the others must agree)
    width_key: str  # one routed expert's intermediate width
    shared_width_key: str | None = None  # the shared expert every token runs
    shared_count_key: str | None = None  # or the shared experts, each one routed expert wide (DeepSeek)
    dense_first_key: str | None = None  # the first layers with a dense MLP, `intermediate_size` wide (DeepSeek)


# Families read as mixtures of experts, from their Hugging Face modeling code: Mixtral's experts are
# `intermediate_size` wide; Qwen2-MoE adds one shared expert (its 1-wide sigmoid gate is not counted) and keeps
# Qwen2's Q, K and V biases; Qwen3-MoE has neither (its per-head Q/K RMSNorm weights, 2 x head_dim a layer,
# are not counted either). Either expert-count name is read for each (newer transformers map Qwen3-MoE's
# `num_experts` onto `num_local_experts`); given both, they must agree.
_MOE_FAMILIES: dict[str, _MoeFamily] = {
    "mixtral": _MoeFamily(("num_local_experts", "num_experts"), "intermediate_size"),
    "qwen2_moe": _MoeFamily(("num_experts", "num_local_experts"), "moe_intermediate_size",
                            "shared_expert_intermediate_size"),
    "qwen3_moe": _MoeFamily(("num_experts", "num_local_experts"), "moe_intermediate_size"),
    "gpt_oss": _MoeFamily(("num_local_experts", "num_experts"), "intermediate_size"),
    # DeepSeek-V2/V3: n_shared_experts experts of moe_intermediate_size, the first first_k_dense_replace layers
    # dense (their MLP intermediate_size wide), latent attention (_LATENT_ATTENTION_FAMILIES).
    "deepseek_v2": _MoeFamily(("n_routed_experts",), "moe_intermediate_size", shared_count_key="n_shared_experts",
                              dense_first_key="first_k_dense_replace"),
    "deepseek_v3": _MoeFamily(("n_routed_experts",), "moe_intermediate_size", shared_count_key="n_shared_experts",
                              dense_first_key="first_k_dense_replace"),
}
# Families whose router and experts always carry biases (GPT-OSS's modeling code), and which attend with a
# learned sink logit per head.
_BIASED_EXPERT_FAMILIES = frozenset({"gpt_oss"})
_ATTENTION_SINK_FAMILIES = frozenset({"gpt_oss"})
_FULL_ATTENTION, _SLIDING_ATTENTION = "full_attention", "sliding_attention"
# Fields that put dense MLP layers among the mixture-of-experts ones, and the one value meaning "none":
# resiplan models every layer alike.
_DENSE_LAYER_FIELDS: dict[str, Any] = {"decoder_sparse_step": 1, "moe_layer_freq": 1, "first_k_dense_replace": 0,
                                       "mlp_only_layers": ()}
# Multi-head latent attention (DeepSeek-V2/V3): low-rank compressed Q and KV projections, read for the families
# whose modeling code builds it.
_LATENT_ATTENTION_KEYS = ("kv_lora_rank", "q_lora_rank")
_LATENT_ATTENTION_FAMILIES = frozenset({"deepseek_v2", "deepseek_v3"})
# Families whose every linear layer has a bias, and whose configs do not say so.
_BIASED_FAMILIES = frozenset({"gpt2", "gpt_bigcode", "gpt_neox", "gpt_neo", "opt", "bloom", "falcon", "phi",
                              "starcoder2", "codegen"})
# Families whose every layer normalizes each head's query and key (Qwen3's q_norm, k_norm).
_QK_NORM_FAMILIES = frozenset({"qwen3", "qwen3_moe"})
# Families with a learned absolute position table.
_LEARNED_POSITION_FAMILIES = frozenset({"gpt2", "gpt_bigcode", "gpt_neo", "opt", "biogpt"})
# Families with biases on Q, K and V only, hard-coded in their modeling code (Qwen2, Qwen2.5).
_QKV_BIAS_FAMILIES = frozenset({"qwen2", "qwen2_vl", "qwen2_5_vl", "qwen2_moe"})


def _int_field(config: dict[str, Any], keys: tuple[str, ...], limit: int, default: int | None = None) -> int:
    """The first present key as a whole number from 1 to `limit`, or HfConfigError naming it."""
    for key in keys:
        value = config.get(key)
        if value is None:
            continue
        is_whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if isinstance(value, bool) or not is_whole or not 1 <= value <= limit:
            raise HfConfigError(f"hf_config {key} must be a whole number from 1 to {limit:,}, got {_shown(value)}")
        return int(value)
    if default is not None:
        return default
    raise HfConfigError(f"hf_config has none of {', '.join(keys)}")


def _float_field(config: dict[str, Any], key: str, default: float, low: float, high: float,
                 where: str = "hf_config") -> float:
    value = config.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value <= high:
        raise HfConfigError(f"{where} {key} must be a number above {low:g} and at most {high:g}, got {_shown(value)}")
    return float(value)


def _shown(value: Any) -> str:
    """A hostile value, short enough for a message."""
    if isinstance(value, int) and value.bit_length() > 128:  # repr of a 5,000-digit int raises
        return f"a {value.bit_length()}-bit number"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _refuse_unread_experts(config: dict[str, Any], family: str, understood: frozenset[str] = frozenset(),
                           where: str = "hf_config") -> None:
    """HfConfigError naming the field when the config names experts in a way not read here: an expert count
    above 1, or a per-token, shared or MoE-only width, a `moe_*` setting, outside `understood` (what the
    family's reader takes), here or one level down."""
    moe_keys = sorted(key for key in config if key.startswith("moe_") and key not in _EXPERT_KEYS)
    for key in (*_EXPERT_KEYS, *moe_keys):
        if key in understood:
            continue
        value = config.get(key)
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if (numeric and value > (1 if key in _EXPERT_COUNT_KEYS else 0)) or value is True:
            raise HfConfigError(
                f"{where} {key} is {_shown(value)}: a mixture-of-experts field resiplan does not read for "
                f"model_type {_shown(family)}; it reads the experts of {', '.join(_MOE_FAMILIES)} configs, and "
                "planning experts as a dense model would get its memory and time wrong"
            )
    if where != "hf_config":
        return  # one level down is where real configs nest (DBRX's ffn_config, a multimodal text_config)
    for key, value in config.items():
        if isinstance(value, dict) and key.endswith("_config"):
            _refuse_unread_experts(value, family, frozenset(), f"{where} {key}")


def _refuse_dense_layers(config: dict[str, Any]) -> None:
    """HfConfigError naming the field when dense MLP layers sit among the mixture-of-experts ones."""
    for key, none in _DENSE_LAYER_FIELDS.items():
        value = config.get(key)
        if value is None:
            continue
        if isinstance(none, tuple):
            plain = isinstance(value, list) and not value
        else:
            plain = isinstance(value, (int, float)) and not isinstance(value, bool) and value == none
        if not plain:
            raise HfConfigError(
                f"hf_config {key} is {_shown(value)}: dense MLP layers among the mixture-of-experts ones are not "
                f"modelled yet; resiplan plans models whose every layer holds the experts, as {key} "
                f"{list(none) if isinstance(none, tuple) else none} says"
            )


def _experts(config: dict[str, Any], family: str) -> tuple[dict[str, int], int | None]:
    """(ModelSpec's expert fields, one routed expert's width) for a family in _MOE_FAMILIES; ({}, None) for a
    dense config. HfConfigError naming the field for experts, or attention, resiplan does not model."""
    for key in _LATENT_ATTENTION_KEYS:
        if config.get(key) is not None and family not in _LATENT_ATTENTION_FAMILIES:
            raise HfConfigError(
                f"hf_config {key} is {_shown(config[key])}: multi-head latent attention (DeepSeek-V2/V3's "
                "low-rank Q and KV projections) is not modelled yet; resiplan prices multi-head and "
                "grouped-query attention"
            )
    moe = _MOE_FAMILIES.get(family)
    if moe is None:
        _refuse_unread_experts(config, family)
        return {}, None
    dense = _dense_first_layers(config, moe)
    understood = frozenset({*moe.count_keys, "num_experts_per_tok", moe.width_key, *_DENSE_LAYER_FIELDS,
                            *(key for key in (moe.shared_width_key, moe.shared_count_key) if key)})
    _refuse_unread_experts(config, family, understood)
    limits = ARCHITECTURE_LIMITS
    num_experts = _int_field(config, moe.count_keys, limits["num_experts"])
    named = next(key for key in moe.count_keys if config.get(key) is not None)
    for key in moe.count_keys:
        if config.get(key) is not None and _int_field(config, (key,), limits["num_experts"]) != num_experts:
            raise HfConfigError(f"hf_config {key} {_shown(config[key])} disagrees with {named} {num_experts}")
    per_token = _int_field(config, ("num_experts_per_tok",), limits["num_experts"])
    if per_token > num_experts:
        raise HfConfigError(
            f"hf_config num_experts_per_tok {per_token:,} exceeds {named} {num_experts:,}: a token runs at most "
            "every expert")
    width = _int_field(config, (moe.width_key,), limits["ffn_hidden_size"])
    shared = _int_field(config, (moe.shared_width_key,), limits["ffn_hidden_size"]) if moe.shared_width_key else 0
    if moe.shared_count_key and config.get(moe.shared_count_key) is not None:
        shared = _int_field(config, (moe.shared_count_key,), limits["num_experts"]) * width
    return {"num_experts": num_experts, "experts_per_token": per_token, "shared_expert_ffn_hidden_size": shared,
            **dense}, width


def _dense_first_layers(config: dict[str, Any], moe: _MoeFamily) -> dict[str, int]:
    """ModelSpec's dense_layers and dense_ffn_hidden_size where the family puts dense layers first; other dense
    layer patterns refused (`_refuse_dense_layers`)."""
    if moe.dense_first_key is None:
        _refuse_dense_layers(config)
        return {}
    _refuse_dense_layers({key: value for key, value in config.items() if key != moe.dense_first_key})
    first = config.get(moe.dense_first_key)
    if first is None or first == 0:
        return {}
    layers = _int_field(config, (moe.dense_first_key,), ARCHITECTURE_LIMITS["num_layers"])
    return {"dense_layers": layers,
            "dense_ffn_hidden_size": _int_field(config, ("intermediate_size",), ARCHITECTURE_LIMITS["ffn_hidden_size"])}


def _latent_attention(config: dict[str, Any], family: str) -> dict[str, int]:
    """ModelSpec's latent attention fields (DeepSeek-V2/V3: kv_lora_rank, q_lora_rank (null: none),
    qk_nope_head_dim as head_dim, qk_rope_head_dim, v_head_dim); {} for other families."""
    if family not in _LATENT_ATTENTION_FAMILIES:
        return {}
    limits = ARCHITECTURE_LIMITS
    depths = config.get("num_nextn_predict_layers")
    mtp = {} if depths in (None, 0) else {"mtp_layers": _int_field(config, ("num_nextn_predict_layers",), 16)}
    q_rank = config.get("q_lora_rank")
    return {"kv_lora_rank": _int_field(config, ("kv_lora_rank",), limits["hidden_size"]),
            "q_lora_rank": 0 if q_rank is None else _int_field(config, ("q_lora_rank",), limits["hidden_size"]),
            "head_dim": _int_field(config, ("qk_nope_head_dim",), limits["head_dim"]),
            "qk_rope_head_dim": _int_field(config, ("qk_rope_head_dim",), limits["head_dim"]),
            "v_head_dim": _int_field(config, ("v_head_dim",), limits["head_dim"]), **mtp}


def _head_fields(config: dict[str, Any], family: str, hidden: int, heads: int) -> dict[str, Any]:
    """`head_dim` when it is not hidden_size / num_attention_heads (Qwen3, Mistral-Nemo: Q and the attention
    output are heads x head_dim wide), and Qwen3's per-head query and key norms (its modeling code always
    builds them)."""
    fields: dict[str, Any] = {}
    if family in _QK_NORM_FAMILIES:
        fields["qk_norm"] = True
    if config.get("head_dim") is None:
        return fields
    head_dim = _int_field(config, ("head_dim",), ARCHITECTURE_LIMITS["head_dim"])
    if head_dim * heads != hidden:
        fields["head_dim"] = head_dim
    return fields


def _bool_field(config: dict[str, Any], key: str) -> bool | None:
    value = config.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise HfConfigError(f"hf_config {key} must be true or false, got {_shown(value)}")


def _rope(config: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from `rope_theta`/`rope_scaling`, or transformers 5's `rope_parameters`."""
    parameters = config.get("rope_parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise HfConfigError(f"hf_config rope_parameters must be an object, got {_shown(parameters)}")
        theta_source, theta_where, scaling, where = parameters, "hf_config rope_parameters", parameters, \
            "hf_config rope_parameters"
    else:
        scaling = config.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise HfConfigError(f"hf_config rope_scaling must be an object or null, got {_shown(scaling)}")
        theta_source, theta_where, where = config, "hf_config", "hf_config rope_scaling"
    theta_key = "rope_theta" if "rope_theta" in theta_source else "rotary_emb_base"
    theta = _float_field(theta_source, theta_key, 10_000.0, 1.0, MAX_ROPE_THETA, theta_where)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == YARN_ROPE:
        return theta, _yarn(scaling, where)
    if kind != LLAMA3_ROPE:
        raise HfConfigError(
            f"{where} type {_shown(kind)} is not supported: resiplan carries Llama 3.1-style (\"llama3\") "
            "and YaRN (\"yarn\") scaling to trainers; drop rope_scaling to plan the model with plain RoPE (its "
            "layout and costs do not depend on it)"
        )
    low = _float_field(scaling, "low_freq_factor", 1.0, 0.0, 1024.0, where)
    high = _float_field(scaling, "high_freq_factor", 4.0, 0.0, 1024.0, where)
    if high <= low:
        raise HfConfigError(f"{where} high_freq_factor {high:g} must exceed low_freq_factor {low:g}")
    return theta, RopeScaling(
        factor=_float_field(scaling, "factor", 8.0, 0.0, 1024.0, where),
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=_int_field(
            scaling, ("original_max_position_embeddings",), ARCHITECTURE_LIMITS["max_position_embeddings"], 8192),
    )


def _yarn(scaling: dict[str, Any], where: str) -> RopeScaling:
    """YaRN scaling (GPT-OSS, DeepSeek): factor, the context it starts from, the ramp's beta_fast and beta_slow,
    and DeepSeek's attention temperature (mscale, mscale_all_dim) where given."""
    fast = _float_field(scaling, "beta_fast", 32.0, 0.0, 1024.0, where)
    slow = _float_field(scaling, "beta_slow", 1.0, 0.0, 1024.0, where)
    if slow >= fast:
        raise HfConfigError(f"{where} beta_fast {fast:g} must exceed beta_slow {slow:g}")
    if _bool_field(scaling, "truncate") is True:
        raise HfConfigError(f"{where} truncate true is not supported: resiplan carries untruncated YaRN (GPT-OSS's) "
                            "to trainers")
    mscales = {key: _float_field(scaling, key, 0.0, -1e-9 if key == "mscale_all_dim" else 0.0, 1024.0, where)
               for key in ("mscale", "mscale_all_dim") if scaling.get(key) is not None}
    return RopeScaling(
        factor=_float_field(scaling, "factor", 32.0, 0.0, 1024.0, where), rope_type=YARN_ROPE,
        beta_fast=fast, beta_slow=slow, **mscales,
        original_max_position_embeddings=_int_field(
            scaling, ("original_max_position_embeddings",), ARCHITECTURE_LIMITS["max_position_embeddings"], 4096))


def _windows(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """`sliding_window` and `full_attention_every` from `layer_types` (transformers' per-layer list of
    "full_attention" and "sliding_attention"): every layer full, or a window on all but every k-th layer (the
    last of each k). Without `layer_types` a config's `sliding_window` is not read (Mistral and Qwen2 configs
    carry one they do not use): every layer is priced as attending to the whole sequence, the dearer."""
    kinds = config.get("layer_types")
    if kinds is None:
        return {}
    if not isinstance(kinds, list) or not all(kind in (_FULL_ATTENTION, _SLIDING_ATTENTION) for kind in kinds):
        raise HfConfigError(f"hf_config layer_types must list \"{_FULL_ATTENTION}\" or \"{_SLIDING_ATTENTION}\" per "
                            f"layer, got {_shown(kinds)}")
    if len(kinds) != num_layers:
        raise HfConfigError(f"hf_config layer_types lists {len(kinds):,} layers, num_hidden_layers says {num_layers:,}")
    full = [index for index, kind in enumerate(kinds) if kind == _FULL_ATTENTION]
    if len(full) == len(kinds):
        return {}
    every = full[0] + 1 if full else 0
    if every and full != list(range(every - 1, len(kinds), every)):
        raise HfConfigError(f"hf_config layer_types {_shown(kinds)}: resiplan prices a window on every layer but "
                            "every k-th (the last of each k), not this pattern")
    window = _int_field(config, ("sliding_window",), ARCHITECTURE_LIMITS["max_position_embeddings"])
    return {"sliding_window": window, "full_attention_every": every}


def _biases(config: dict[str, Any], family: str) -> tuple[bool, bool]:
    """(qkv_bias, linear_bias): explicit `attention_bias`/`mlp_bias` (or a blanket `bias`/`use_bias`) win over
    what the family's modeling code hard-codes."""
    blanket = _bool_field(config, "bias")
    blanket = _bool_field(config, "use_bias") if blanket is None else blanket
    attention, mlp = _bool_field(config, "attention_bias"), _bool_field(config, "mlp_bias")
    if family in _BIASED_EXPERT_FAMILIES:
        if attention is False or blanket is False:
            raise HfConfigError(f"hf_config attention_bias false with model_type {family} is not supported: its "
                                "router and experts always have biases, and resiplan describes biases on every "
                                "linear layer or on none")
        return False, True
    if family in _QKV_BIAS_FAMILIES and attention is None and blanket is None:
        return _bool_field(config, "qkv_bias") is not False, False  # newer Qwen2-MoE configs name it
    default = family in _BIASED_FAMILIES if blanket is None else blanket
    attention = default if attention is None else attention
    mlp = default if mlp is None else mlp
    if attention != mlp:
        raise HfConfigError(
            f"hf_config attention_bias {str(attention).lower()} with mlp_bias {str(mlp).lower()} is not supported: "
            "resiplan describes biases on every linear layer, or on Q, K and V only, as Megatron-LM builds them"
        )
    return False, attention


def model_from_hf_config(config: dict[str, Any]) -> ModelSpec:
    """Read the architecture out of a Hugging Face config.json, as-is, within ARCHITECTURE_LIMITS.

    Gated activations (silu/swiglu, as in Llama, Qwen, Mistral) are detected
    from `hidden_act` together with the presence of `intermediate_size`;
    GPT-2 style configs (`n_inner` or 4 * hidden) are non-gated.
    Normalization: RMSNorm when `rms_norm_eps` is given, LayerNorm when
    `layer_norm_eps`/`layer_norm_epsilon` is, else RMSNorm. Positions: a
    learned table for GPT-2-like families (`n_positions` rows), else RoPE.
    `head_dim` is read when it differs from hidden_size / num_attention_heads,
    and Qwen3's per-head query/key norms from its family. Gemma is refused
    (its GeGLU MLP and extra norms are not modelled).

    Mixtures of experts are read for model_type mixtral (`num_local_experts`,
    `num_experts_per_tok`, experts `intermediate_size` wide), qwen2_moe
    (`num_experts`, `num_experts_per_tok`, `moe_intermediate_size`, and a
    shared expert `shared_expert_intermediate_size` wide; Q, K, V biases)
    and qwen3_moe (as qwen2_moe without the shared expert or the biases), and
    gpt_oss (`num_local_experts`, experts `intermediate_size` wide, biases on
    every linear layer, the router's and the experts' included, attention
    sinks, YaRN RoPE scaling); ffn_hidden_size is then one routed expert's
    width. Sliding windows are read from `layer_types` (a window on all layers
    but every k-th). Refused, with an
    HfConfigError naming the field: dense layers among the expert ones
    (`decoder_sparse_step` > 1, `mlp_only_layers`, `first_k_dense_replace`,
    `moe_layer_freq` other than 1), DeepSeek-V2/V3's latent attention
    (`kv_lora_rank`, `q_lora_rank`), and experts named any other way (other
    families, DBRX's nested `ffn_config`, `moe_*` keys not read).
    """
    family = str(config.get("model_type") or "")
    expert_fields, expert_width = _experts(config, family)
    limits = ARCHITECTURE_LIMITS
    num_layers = _int_field(config, _HF_ALIASES["num_layers"], limits["num_layers"])
    hidden = _int_field(config, _HF_ALIASES["hidden_size"], limits["hidden_size"])
    heads = _int_field(config, _HF_ALIASES["num_attention_heads"], limits["num_attention_heads"])
    kv_heads = _int_field(config, ("num_key_value_heads",), limits["num_kv_heads"], default=heads)
    vocab = _int_field(config, ("vocab_size",), limits["vocab_size"])
    if family.startswith("gemma"):
        raise HfConfigError(f"hf_config model_type {_shown(family)} is not supported: Gemma's GeGLU MLP, scaled "
                            "embedding and extra norms are not modelled")
    head_fields = _latent_attention(config, family) or _head_fields(config, family, hidden, heads)
    if family not in _LATENT_ATTENTION_FAMILIES and config.get("num_nextn_predict_layers") not in (None, 0):
        raise HfConfigError(f"hf_config num_nextn_predict_layers is {_shown(config['num_nextn_predict_layers'])}: "
                            f"multi-token prediction is modelled as DeepSeek-V3 builds it, not for model_type "
                            f"{_shown(family)}")
    default_activation = "silu" if expert_fields else "gelu"  # the MoE families' configs default to silu
    activation = str(config.get("hidden_act") or config.get("activation_function") or default_activation).lower()
    gated = "intermediate_size" in config and activation in {"silu", "swiglu", "swish"}
    if expert_fields:
        if activation not in {"silu", "swiglu", "swish"}:
            raise HfConfigError(f"hf_config hidden_act {_shown(activation)} with experts is not supported: "
                                "resiplan's experts are SwiGLU MLPs, as Mixtral's and Qwen-MoE's are")
        gated = True  # the experts' gate, up and down projections, whether intermediate_size is given or not
    ffn = expert_width or _int_field(config, ("intermediate_size", "n_inner"), limits["ffn_hidden_size"],
                                     default=4 * hidden)
    if ffn > limits["ffn_hidden_size"]:
        raise HfConfigError(f"hf_config hidden_size {hidden:,} gives an MLP of 4 x {hidden:,} = {ffn:,}; "
                            f"at most {limits['ffn_hidden_size']:,} is supported")
    name = str(config.get("_name_or_path") or config.get("model_type") or "hf-model")
    if len(name) > MAX_MODEL_NAME_CHARS:
        field = "_name_or_path" if config.get("_name_or_path") else "model_type"
        raise HfConfigError(
            f"hf_config {field} is {len(name):,} characters; at most {MAX_MODEL_NAME_CHARS} are supported")
    if "rms_norm_eps" in config or not any(key in config for key in ("layer_norm_eps", "layer_norm_epsilon")):
        normalization, epsilon_key = RMSNORM, "rms_norm_eps"
    else:
        normalization = LAYERNORM
        epsilon_key = "layer_norm_eps" if "layer_norm_eps" in config else "layer_norm_epsilon"
    epsilon = _float_field(config, epsilon_key, 1e-5, 0.0, 1.0)
    qkv_bias, linear_bias = _biases(config, family)
    fields: dict[str, Any] = {**_windows(config, num_layers)}
    if family in _ATTENTION_SINK_FAMILIES:
        fields["attention_sinks"] = True
    if expert_fields and config.get("experts_per_token") not in (None, expert_fields["experts_per_token"]):
        raise HfConfigError(f"hf_config experts_per_token {_shown(config['experts_per_token'])} disagrees with "
                            f"num_experts_per_tok {expert_fields['experts_per_token']}")
    if family in _LEARNED_POSITION_FAMILIES:
        fields["position_embedding"] = LEARNED
        fields["max_position_embeddings"] = _int_field(
            config, ("n_positions", "max_position_embeddings"), limits["max_position_embeddings"])
    else:
        fields["rope_theta"], fields["rope_scaling"] = _rope(config)
        fields["rotary_percent"] = _float_field(config, "rotary_pct", 1.0, 0.0, 1.0)
        if "partial_rotary_factor" in config:
            fields["rotary_percent"] = _float_field(config, "partial_rotary_factor", 1.0, 0.0, 1.0)
    return ModelSpec(
        name=name,
        num_layers=num_layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        vocab_size=vocab,
        swiglu=gated,
        tied_embeddings=_bool_field(config, "tie_word_embeddings") is not False,  # HF default: tied
        normalization=normalization,
        norm_epsilon=epsilon,
        qkv_bias=qkv_bias,
        linear_bias=linear_bias,
        **expert_fields,
        **head_fields,
        **fields,
    )
