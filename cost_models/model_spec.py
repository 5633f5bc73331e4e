"""Transformer architectures: presets, Hugging Face configs, parameter counts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cost_models.preset_files import preset_table

RMSNORM, LAYERNORM = "rmsnorm", "layernorm"
ROPE, LEARNED = "rope", "learned"

# The one set of architecture limits: the wire's ModelArchitecture and the Hugging Face config
# parser both check these, so every way of naming a model is refused alike before any solve.
ARCHITECTURE_LIMITS: dict[str, int] = {
    "num_layers": 1024,
    "hidden_size": 262_144,
    "ffn_hidden_size": 1_048_576,
    "num_attention_heads": 4096,
    "num_kv_heads": 4096,
    "vocab_size": 4_194_304,
    "max_position_embeddings": 1_048_576,
    "num_experts": 4096,
    "head_dim": 16_384,
}
MAX_MODEL_NAME_CHARS = 128
MAX_ROPE_THETA = 1e9


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1-style RoPE frequency scaling (Hugging Face `"rope_type": "llama3"`): wavelengths longer
    than original_max_position_embeddings / low_freq_factor are divided by `factor`, shorter than
    .../high_freq_factor kept, the ones between interpolated."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer.

    ffn_hidden_size: MLP intermediate width (per branch for SwiGLU).
    num_kv_heads: key/value heads (== num_attention_heads without GQA).
    swiglu: gated MLP with three weight matrices instead of two.
    tied_embeddings: the output head shares the input embedding's weights.
    normalization: "rmsnorm" (a weight) or "layernorm" (a weight and a bias), before attention, before
        the MLP, and once after the last layer.
    norm_epsilon: the normalization's epsilon.
    position_embedding: "rope" (rotary, no weights) or "learned" (a max_position_embeddings x hidden table).
    rope_theta: RoPE base; rotary_percent: share of each head's dimensions rotated (1.0: all).
    rope_scaling: Llama 3.1-style frequency scaling, or None.
    max_position_embeddings: rows of the learned position table (None with RoPE).
    qkv_bias: biases on the Q, K and V projections only (Qwen2).
    linear_bias: biases on every linear layer of a transformer layer (GPT-2/3): QKV, attention output,
        MLP. Implies the QKV biases.
    num_experts: routed experts of every layer's MLP (0: a dense MLP). A mixture-of-experts layer holds a
        router (hidden x num_experts), num_experts experts of width ffn_hidden_size (each an MLP of the
        model's kind, gated with swiglu) and, with shared_expert_ffn_hidden_size, shared experts every
        token runs, of that total width (Qwen2-MoE's shared expert, DeepSeek's n_shared x expert width).
    experts_per_token: routed experts each token runs (top-k), 1 to num_experts.
    head_dim: each attention head's width (None: hidden_size / num_attention_heads); Qwen3, Mistral-Nemo and
        Gemma set it apart, so that Q and the attention output are num_attention_heads x head_dim wide.
    qk_norm: an RMSNorm on each head's query and key (Qwen3; Megatron-LM's --qk-layernorm).
    """

    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    vocab_size: int
    swiglu: bool
    tied_embeddings: bool
    normalization: str = RMSNORM
    norm_epsilon: float = 1e-5
    position_embedding: str = ROPE
    rope_theta: float = 10_000.0
    rotary_percent: float = 1.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int | None = None
    qkv_bias: bool = False
    linear_bias: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    shared_expert_ffn_hidden_size: int = 0
    head_dim: int | None = None
    qk_norm: bool = False

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of one MLP (or one expert): gate, up and down with SwiGLU, else up and down."""
        return 3 if self.swiglu else 2

    @property
    def mlp_width_per_token(self) -> int:
        """The MLP width one token runs through: the dense MLP's, or its routed experts' and the shared
        experts' together (what a token's MLP FLOPs and stored activations scale with)."""
        if not self.is_moe:
            return self.ffn_hidden_size
        return self.experts_per_token * self.ffn_hidden_size + self.shared_expert_ffn_hidden_size

    @property
    def routed_expert_params_per_layer(self) -> int:
        """Weights of one layer's routed experts (0 for a dense model): what expert parallelism shards."""
        return self.num_experts * self.mlp_matrices * self.hidden_size * self.ffn_hidden_size if self.is_moe else 0

    @property
    def head_width(self) -> int:
        """Each attention head's width: `head_dim`, or hidden_size / num_attention_heads."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def q_width(self) -> int:
        """Output width of the Q projection, and input width of the attention output projection."""
        return self.num_attention_heads * self.head_width

    @property
    def kv_width(self) -> int:
        """Output width of the K (or V) projection."""
        return self.num_kv_heads * self.head_width

    @property
    def norm_params(self) -> int:
        """Weights of one normalization: RMSNorm a scale, LayerNorm a scale and a shift."""
        return (2 if self.normalization == LAYERNORM else 1) * self.hidden_size

    @property
    def params_per_layer(self) -> int:
        """Weights of one transformer layer: the matrices, their biases where the model has them, two norms."""
        h, f = self.hidden_size, self.ffn_hidden_size
        qkv_width = self.q_width + 2 * self.kv_width
        attention = h * qkv_width + self.q_width * h + (2 * self.head_width if self.qk_norm else 0)
        mlp_matrices = self.mlp_matrices
        mlp = mlp_matrices * h * f
        if self.is_moe:  # the router, every routed expert and the shared experts
            mlp = h * self.num_experts + self.routed_expert_params_per_layer
            mlp += mlp_matrices * h * self.shared_expert_ffn_hidden_size
        biases = 0
        if self.qkv_bias or self.linear_bias:
            biases += qkv_width
        if self.linear_bias:
            # attention output, the MLP's input projection(s) (gate and up for SwiGLU) and its output
            biases += h + (mlp_matrices - 1) * f + h
        return attention + mlp + biases + 2 * self.norm_params

    @property
    def embedding_params(self) -> int:
        """Weights on the first stage: the token embedding, and the learned position table if there is one."""
        positions = (self.max_position_embeddings or 0) if self.position_embedding == LEARNED else 0
        return (self.vocab_size + positions) * self.hidden_size

    @property
    def head_params(self) -> int:
        """Output projection weights stored on the last stage (a copy when tied)."""
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        head = 0 if self.tied_embeddings else self.head_params
        return self.num_layers * self.params_per_layer + self.embedding_params + head + self.norm_params

    @property
    def active_params(self) -> int:
        """Weights one token runs through: `total_params` less the routed experts it skips (the figure
        mixture-of-experts models publish as "active")."""
        skipped = self.num_experts - self.experts_per_token if self.is_moe else 0
        per_expert = self.mlp_matrices * self.hidden_size * self.ffn_hidden_size
        return self.total_params - self.num_layers * skipped * per_expert


def model_preset_names() -> list[str]:
    return sorted(preset_table("models.json"))


def model_preset(name: str) -> ModelSpec:
    """The preset model called `name`; KeyError if there is none."""
    fields = dict(preset_table("models.json")[name])
    scaling = fields.pop("rope_scaling", None)
    return ModelSpec(name=name, rope_scaling=RopeScaling(**scaling) if scaling else None, **fields)


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
}
# Fields that put dense MLP layers among the mixture-of-experts ones, and the one value meaning "none":
# resiplan models every layer alike.
_DENSE_LAYER_FIELDS: dict[str, Any] = {"decoder_sparse_step": 1, "moe_layer_freq": 1, "first_k_dense_replace": 0,
                                       "mlp_only_layers": ()}
# Multi-head latent attention (DeepSeek-V2/V3): low-rank compressed Q and KV projections.
_LATENT_ATTENTION_KEYS = ("kv_lora_rank", "q_lora_rank")
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
        if config.get(key) is not None:
            raise HfConfigError(
                f"hf_config {key} is {_shown(config[key])}: multi-head latent attention (DeepSeek-V2/V3's "
                "low-rank Q and KV projections) is not modelled yet; resiplan prices multi-head and "
                "grouped-query attention"
            )
    moe = _MOE_FAMILIES.get(family)
    if moe is None:
        _refuse_unread_experts(config, family)
        return {}, None
    _refuse_dense_layers(config)
    understood = frozenset({*moe.count_keys, "num_experts_per_tok", moe.width_key, *_DENSE_LAYER_FIELDS,
                            *([moe.shared_width_key] if moe.shared_width_key else [])})
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
    return {"num_experts": num_experts, "experts_per_token": per_token, "shared_expert_ffn_hidden_size": shared}, \
        width


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
    if kind != "llama3":
        raise HfConfigError(
            f"{where} type {_shown(kind)} is not supported: resiplan carries Llama 3.1-style (\"llama3\") "
            "scaling to trainers; drop rope_scaling to plan the model with plain RoPE (its layout and costs "
            "do not depend on it)"
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


def _biases(config: dict[str, Any], family: str) -> tuple[bool, bool]:
    """(qkv_bias, linear_bias): explicit `attention_bias`/`mlp_bias` (or a blanket `bias`/`use_bias`) win over
    what the family's modeling code hard-codes."""
    blanket = _bool_field(config, "bias")
    blanket = _bool_field(config, "use_bias") if blanket is None else blanket
    attention, mlp = _bool_field(config, "attention_bias"), _bool_field(config, "mlp_bias")
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
    and qwen3_moe (as qwen2_moe without the shared expert or the biases);
    ffn_hidden_size is then one routed expert's width. Refused, with an
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
    head_fields = _head_fields(config, family, hidden, heads)
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
    if expert_fields and linear_bias:
        raise HfConfigError("hf_config biases on every linear layer (bias, or attention_bias with mlp_bias) with "
                            "experts are not supported: resiplan prices mixture-of-experts layers without MLP "
                            "biases, as Mixtral and Qwen-MoE are built")
    fields: dict[str, Any] = {}
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
