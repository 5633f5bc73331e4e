"""Transformer architectures: presets, Hugging Face configs, parameter counts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cost_models.preset_files import preset_table


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer.

    ffn_hidden_size: MLP intermediate width (per branch for SwiGLU).
    num_kv_heads: key/value heads (== num_attention_heads without GQA).
    swiglu: gated MLP with three weight matrices instead of two.
    tied_embeddings: the output head shares the input embedding's weights.
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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_width(self) -> int:
        """Output width of the K (or V) projection."""
        return self.num_kv_heads * self.head_dim

    @property
    def params_per_layer(self) -> int:
        """Weights of one transformer layer (matrices plus two norms; biases ignored)."""
        h = self.hidden_size
        attention = h * (h + 2 * self.kv_width) + h * h
        mlp_matrices = 3 if self.swiglu else 2
        mlp = mlp_matrices * h * self.ffn_hidden_size
        return attention + mlp + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """Output projection weights stored on the last stage (a copy when tied)."""
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        head = 0 if self.tied_embeddings else self.head_params
        return self.num_layers * self.params_per_layer + self.embedding_params + head + self.hidden_size


def model_preset_names() -> list[str]:
    return sorted(preset_table("models.json"))


def model_preset(name: str) -> ModelSpec:
    """The preset model called `name`; KeyError if there is none."""
    return ModelSpec(name=name, **preset_table("models.json")[name])


class HfConfigError(ValueError):
    """A Hugging Face config.json lacks a field resiplan needs."""


_HF_ALIASES: dict[str, tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_attention_heads": ("num_attention_heads", "n_head"),
}


# Larger than any real architecture; keeps hostile numbers out of the arithmetic.
_HF_INT_LIMIT = 1 << 24


def _int_field(config: dict[str, Any], keys: tuple[str, ...], default: int | None = None) -> int:
    """The first present key as a positive whole number, or HfConfigError naming it."""
    for key in keys:
        value = config.get(key)
        if value is None:
            continue
        is_whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if isinstance(value, bool) or not is_whole or not 1 <= value <= _HF_INT_LIMIT:
            raise HfConfigError(f"hf_config {key} must be a whole number from 1 to {_HF_INT_LIMIT}, got {value!r}")
        return int(value)
    if default is not None:
        return default
    raise HfConfigError(f"hf_config has none of {', '.join(keys)}")


def model_from_hf_config(config: dict[str, Any]) -> ModelSpec:
    """Read the architecture out of a Hugging Face config.json, as-is.

    Gated activations (silu/swiglu, as in Llama, Qwen, Mistral) are detected
    from `hidden_act` together with the presence of `intermediate_size`;
    GPT-2 style configs (`n_inner` or 4 * hidden) are non-gated.
    """
    num_layers = _int_field(config, _HF_ALIASES["num_layers"])
    hidden = _int_field(config, _HF_ALIASES["hidden_size"])
    heads = _int_field(config, _HF_ALIASES["num_attention_heads"])
    kv_heads = _int_field(config, ("num_key_value_heads",), default=heads)
    vocab = _int_field(config, ("vocab_size",))
    activation = str(config.get("hidden_act") or config.get("activation_function") or "gelu").lower()
    gated = "intermediate_size" in config and activation in {"silu", "swiglu", "swish"}
    ffn = _int_field(config, ("intermediate_size", "n_inner"), default=4 * hidden)
    name = str(config.get("_name_or_path") or config.get("model_type") or "hf-model")
    return ModelSpec(
        name=name,
        num_layers=num_layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        vocab_size=vocab,
        swiglu=gated,
        tied_embeddings=bool(config.get("tie_word_embeddings", True)),  # HF default
    )
