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
    mscale: float | None = Field(default=None, gt=0, le=1024,
                                 description="yarn only: the attention temperature's mscale (DeepSeek-V2/V3), or null.")
    mscale_all_dim: float | None = Field(default=None, ge=0, le=1024,
                                         description="yarn only: its mscale_all_dim (DeepSeek-V2/V3), or null.")

    @model_validator(mode="after")
    def _bands(self) -> RopeScalingModel:
        if self.rope_type != "yarn" and (self.mscale is not None or self.mscale_all_dim is not None):
            raise ValueError("rope_scaling mscale and mscale_all_dim are YaRN's: give rope_type yarn")
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
    q_lora_rank: int = Field(default=0, ge=0, le=ARCHITECTURE_LIMITS["hidden_size"],
                             description="Multi-head latent attention: the query latent's width (0: queries "
                                         "projected directly; DeepSeek-V3 1536).")
    kv_lora_rank: int = Field(default=0, ge=0, le=ARCHITECTURE_LIMITS["hidden_size"],
                              description="Multi-head latent attention when > 0: the key/value latent's width "
                                          "(DeepSeek-V2/V3 512); head_dim is then each head's qk_nope_head_dim.")
    qk_rope_head_dim: int = Field(default=0, ge=0, le=ARCHITECTURE_LIMITS["head_dim"],
                                  description="Latent attention: rotary dimensions every head's query and key add "
                                              "(DeepSeek 64).")
    v_head_dim: int = Field(default=0, ge=0, le=ARCHITECTURE_LIMITS["head_dim"],
                            description="Latent attention: each head's value width (0: head_dim; DeepSeek 128).")
    dense_layers: int = Field(default=0, ge=0, le=ARCHITECTURE_LIMITS["num_layers"],
                              description="Mixture of experts: the first layers whose MLP is dense "
                                          "(DeepSeek-V3's first_k_dense_replace 3).")
    mtp_layers: int = Field(default=0, ge=0, le=16,
                            description="Multi-token prediction depths (DeepSeek-V3's num_nextn_predict_layers 1): "
                                        "each a projection, one transformer layer and norms on the last stage, "
                                        "sharing the embedding and the output head.")
    dense_ffn_hidden_size: int = Field(default=0, ge=0, le=ARCHITECTURE_LIMITS["ffn_hidden_size"],
                                       description="Width of those dense MLPs (DeepSeek-V3 18432).")

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
    def _latent_attention(self) -> ModelArchitecture:
        if not self.kv_lora_rank:
            if self.q_lora_rank or self.qk_rope_head_dim or self.v_head_dim:
                raise ValueError("q_lora_rank, qk_rope_head_dim and v_head_dim describe multi-head latent attention: "
                                 "give kv_lora_rank too (0 means multi-head or grouped-query attention)")
            return self
        problems = []
        if self.head_dim is None:
            problems.append("head_dim (each head's qk_nope_head_dim) is required")
        if not self.qk_rope_head_dim:
            problems.append("qk_rope_head_dim must be at least 1")
        if (self.num_kv_heads or self.num_attention_heads) != self.num_attention_heads:
            problems.append("num_kv_heads must equal num_attention_heads (every head gets its own key and value)")
        if self.qkv_bias or self.linear_bias or self.qk_norm:
            problems.append("qkv_bias, linear_bias and qk_norm are not modelled with it")
        if self.sliding_window is not None or self.attention_sinks:
            problems.append("sliding windows and attention sinks are not modelled with it")
        if problems:
            raise ValueError("multi-head latent attention (kv_lora_rank > 0): " + "; ".join(problems))
        return self

    @model_validator(mode="after")
    def _dense_layers(self) -> ModelArchitecture:
        if not self.dense_layers and not self.dense_ffn_hidden_size:
            return self
        if not self.num_experts:
            raise ValueError("dense_layers and dense_ffn_hidden_size put dense layers among a mixture of experts' "
                             "layers: give num_experts too")
        if not 1 <= self.dense_layers < self.num_layers or not self.dense_ffn_hidden_size:
            raise ValueError(f"dense_layers must be from 1 to num_layers - 1 ({self.num_layers - 1}), with "
                             f"dense_ffn_hidden_size at least 1; got {self.dense_layers} and "
                             f"{self.dense_ffn_hidden_size}")
        if self.linear_bias:
            raise ValueError("dense_layers with linear_bias is not modelled")
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
