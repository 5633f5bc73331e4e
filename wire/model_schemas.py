"""Wire models of a model's architecture: an object of its fields, or a Hugging Face config.json as-is.
Field names here are the public contract (API.md, `model`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from cost_models.hf_config import HfConfigError, model_from_hf_config
from cost_models.model_spec import (
    ARCHITECTURE_LIMITS,
    MAX_MODEL_NAME_CHARS,
    MAX_ROPE_THETA,
)
from wire.strict import _Strict


class RopeScalingModel(_Strict):
    """RoPE frequency scaling: Llama 3.1's (Hugging Face `"rope_type": "llama3"`) or YaRN's (`"yarn"`, GPT-OSS)."""

    rope_type: Literal["llama3", "yarn"] = "llama3"
    factor: float = Field(gt=0, le=1024, description="Long wavelengths are divided by this (8 in Llama 3.1, 32 in "
                                                     "GPT-OSS).")
    low_freq_factor: float = Field(default=1.0, gt=0, le=1024, description="llama3 only.")
    high_freq_factor: float = Field(default=4.0, gt=0, le=1024, description="llama3 only.")
    original_max_position_embeddings: int = Field(
        default=8192, ge=1, le=ARCHITECTURE_LIMITS["max_position_embeddings"],
        description="Context length the scaling starts from.",
    )
    beta_fast: float = Field(default=32.0, gt=0, le=1024, description="yarn only: rotations where the ramp starts.")
    beta_slow: float = Field(default=1.0, gt=0, le=1024, description="yarn only: rotations where it ends.")

    @model_validator(mode="after")
    def _bands(self) -> RopeScalingModel:
        if self.rope_type == "yarn":
            if self.beta_slow >= self.beta_fast:
                raise ValueError(f"rope_scaling beta_fast {self.beta_fast:g} must exceed beta_slow {self.beta_slow:g}")
            return self
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"rope_scaling high_freq_factor {self.high_freq_factor:g} must exceed "
                             f"low_freq_factor {self.low_freq_factor:g}")
        return self


class ModelArchitecture(_Strict):
    num_layers: int = Field(ge=1, le=ARCHITECTURE_LIMITS["num_layers"])
    hidden_size: int = Field(ge=1, le=ARCHITECTURE_LIMITS["hidden_size"])
    ffn_hidden_size: int = Field(ge=1, le=ARCHITECTURE_LIMITS["ffn_hidden_size"])
    num_attention_heads: int = Field(ge=1, le=ARCHITECTURE_LIMITS["num_attention_heads"])
    num_kv_heads: int | None = Field(
        default=None, ge=1, le=ARCHITECTURE_LIMITS["num_kv_heads"], description="Defaults to num_attention_heads."
    )
    vocab_size: int = Field(ge=1, le=ARCHITECTURE_LIMITS["vocab_size"])
    swiglu: bool = True
    tied_embeddings: bool = False
    name: str = Field(default="custom", max_length=MAX_MODEL_NAME_CHARS)
    normalization: Literal["rmsnorm", "layernorm"] = Field(
        default="rmsnorm", description="rmsnorm (a weight) or layernorm (a weight and a bias)."
    )
    norm_epsilon: float = Field(default=1e-5, gt=0, le=1)
    position_embedding: Literal["rope", "learned"] = Field(
        default="rope", description="rope (rotary) or learned (a table of max_position_embeddings rows)."
    )
    rope_theta: float = Field(default=10_000.0, ge=1, le=MAX_ROPE_THETA, description="RoPE base.")
    rotary_percent: float = Field(default=1.0, gt=0, le=1, description="Share of each head's dimensions RoPE rotates.")
    rope_scaling: RopeScalingModel | None = Field(default=None, description="Llama 3.1-style scaling, or null.")
    max_position_embeddings: int | None = Field(
        default=None, ge=1, le=ARCHITECTURE_LIMITS["max_position_embeddings"],
        description="Rows of the learned position table; required with position_embedding learned.",
    )
    qkv_bias: bool = Field(default=False, description="Biases on Q, K and V only (Qwen2).")
    linear_bias: bool = Field(default=False, description="Biases on every linear layer of a transformer layer (GPT-3; with "
                                                         "experts, the router's and every expert's too, GPT-OSS).")
    num_experts: int = Field(
        default=0, ge=0, le=ARCHITECTURE_LIMITS["num_experts"],
        description="Routed experts per layer (mixture of experts; 0: a dense MLP). Each expert is an MLP of "
                    "width ffn_hidden_size.")
    experts_per_token: int = Field(
        default=0, ge=0, le=ARCHITECTURE_LIMITS["num_experts"],
        description="Routed experts each token runs (top-k); required with num_experts.")
    shared_expert_ffn_hidden_size: int = Field(
        default=0, ge=0, le=ARCHITECTURE_LIMITS["ffn_hidden_size"],
        description="Total width of the shared experts every token runs (0: none); mixture of experts only.")
    head_dim: int | None = Field(
        default=None, ge=1, le=ARCHITECTURE_LIMITS["head_dim"],
        description="Each attention head's width when it is not hidden_size / num_attention_heads (Qwen3, "
                    "Mistral-Nemo): Q and the attention output are then num_attention_heads x head_dim wide.")
    qk_norm: bool = Field(default=False, description="An RMSNorm on each head's query and key (Qwen3).")
    attention_sinks: bool = Field(default=False, description="A learned softmax logit per head and layer (GPT-OSS).")
    sliding_window: int | None = Field(
        default=None, ge=1, le=ARCHITECTURE_LIMITS["max_position_embeddings"],
        description="Tokens a windowed layer's query attends to (itself included), or null: every layer attends "
                    "to the whole sequence.")
    full_attention_every: int = Field(
        default=1, ge=0, le=ARCHITECTURE_LIMITS["num_layers"],
        description="With sliding_window: every k-th layer (layers k-1, 2k-1, ...) attends to the whole sequence, "
                    "the others within the window (GPT-OSS 2; 0: every layer windowed).")

    @model_validator(mode="after")
    def _experts(self) -> ModelArchitecture:
        if self.num_experts == 0:
            if self.experts_per_token or self.shared_expert_ffn_hidden_size:
                raise ValueError("experts_per_token and shared_expert_ffn_hidden_size describe a mixture of "
                                 "experts: give num_experts too (0 means a dense MLP)")
            return self
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token must be from 1 to num_experts ({self.num_experts}), "
                             f"got {self.experts_per_token}")
        return self

    @model_validator(mode="after")
    def _windows(self) -> ModelArchitecture:
        if self.sliding_window is None and self.full_attention_every != 1:
            raise ValueError("full_attention_every says which layers attend beyond a sliding window: give "
                             "sliding_window too (null: every layer attends to the whole sequence)")
        return self

    @model_validator(mode="after")
    def _shape(self) -> ModelArchitecture:
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        kv = self.num_kv_heads or self.num_attention_heads
        if self.num_attention_heads % kv:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of num_kv_heads {kv}")
        if self.position_embedding == "learned" and self.max_position_embeddings is None:
            raise ValueError("position_embedding learned needs max_position_embeddings, the rows of its table")
        if self.position_embedding == "learned" and self.rope_scaling is not None:
            raise ValueError("rope_scaling applies to position_embedding rope, not learned")
        return self


class HfConfigModel(_Strict):
    hf_config: dict[str, Any] = Field(description="A Hugging Face config.json, as-is.")

    @model_validator(mode="after")
    def _plannable(self) -> HfConfigModel:
        """The architecture limits of ModelArchitecture, checked here, before any solve, in hf_config's terms."""
        try:
            spec = model_from_hf_config(self.hf_config)
        except (HfConfigError, TypeError) as error:
            raise ValueError(str(error)) from None
        try:
            ModelArchitecture.model_validate(dataclasses.asdict(spec))
        except ValidationError as error:
            problems = "; ".join(item["msg"].removeprefix("Value error, ") for item in error.errors())
            raise ValueError(f"hf_config describes a model resiplan cannot plan: {problems}") from None
        return self
