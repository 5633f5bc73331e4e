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


LLAMA3_ROPE, YARN_ROPE = "llama3", "yarn"


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, Llama 3.1's (Hugging Face `"rope_type": "llama3"`: wavelengths longer than
    original_max_position_embeddings / low_freq_factor are divided by `factor`, shorter than
    .../high_freq_factor kept, the ones between interpolated) or YaRN's (`"yarn"`, GPT-OSS: the same
    `factor` over original_max_position_embeddings, ramped between beta_fast and beta_slow rotations).
    Neither changes a layer's cost; trainers must be told which."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = LLAMA3_ROPE
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # YaRN's attention temperature (DeepSeek-V2/V3: softmax scale x mscale(factor, mscale_all_dim)^2);
    # None where the config leaves it to the default (GPT-OSS).
    mscale: float | None = None
    mscale_all_dim: float | None = None


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
    linear_bias with experts: the router, and every expert's projections, have biases too (GPT-OSS).
    attention_sinks: a learned logit per head and layer that every query's softmax also normalizes over
        (GPT-OSS); a weight per head, no FLOPs worth counting.
    sliding_window: tokens a windowed layer's query attends to (itself and the ones before it), or None
        (every layer attends to the whole sequence). With it, every `full_attention_every`-th layer (layers
        k - 1, 2k - 1, ...) still attends to the whole sequence and the others within the window (GPT-OSS:
        window 128, every 2nd layer full; 0: every layer windowed).
    kv_lora_rank: multi-head latent attention (DeepSeek-V2/V3) when > 0. Keys and values are projected down to
        a latent this wide plus `qk_rope_head_dim` rotary dimensions shared by every head (one RMSNorm on the
        latent), then up to every head's key (`head_dim` wide, plus the shared rotary part) and value
        (`v_head_dim` wide); queries likewise through a `q_lora_rank` latent (0: projected directly).
        num_kv_heads equals num_attention_heads.
    dense_layers: in a mixture of experts, the first layers whose MLP is dense, `dense_ffn_hidden_size`
        wide (DeepSeek-V3's first_k_dense_replace 3, 18,432 wide). `params_per_layer` is an expert
        layer's; stages price every layer at the larger of the two per GPU (`layer_params_per_gpu`) and
        at the mean FLOPs (`mlp_width_per_token`): for DeepSeek-V3 a dense layer's MLP FLOPs equal an expert
        layer's (18,432 = 8 routed + 1 shared expert of 2,048).
    mtp_layers: multi-token prediction depths (DeepSeek-V3's num_nextn_predict_layers 1, report section 2.2): each
        predicts one token further from the previous depth's hidden state and the next token's embedding, through
        two RMSNorms, a projection of both (2h x h), one transformer layer (an expert layer's) and a final norm, with
        the main model's embedding and output head. On the last pipeline stage (Megatron's default).
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
    attention_sinks: bool = False
    sliding_window: int | None = None
    full_attention_every: int = 1
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    dense_layers: int = 0
    dense_ffn_hidden_size: int = 0
    mtp_layers: int = 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def expert_layers(self) -> int:
        """Layers holding a mixture of experts (0 for a dense model)."""
        return self.num_layers - self.dense_layers if self.is_moe else 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def windowed_layers(self) -> int:
        """Layers whose queries attend within `sliding_window` only."""
        if self.sliding_window is None:
            return 0
        every = self.full_attention_every
        return self.num_layers - (self.num_layers // every if every else 0)

    def attended_keys_fraction(self, seq_length: int) -> float:
        """Keys each query sees, over the sequence length, averaged over the layers: 1 without windows.
        Layers are priced alike (a stage of n layers is n mean layers; with alternating windows a stage's
        true attention differs from that by at most half a layer's)."""
        windowed = self.windowed_layers
        if not windowed:
            return 1.0
        return (self.num_layers - windowed + windowed * min(1.0, self.sliding_window / seq_length)) / self.num_layers

    @property
    def expert_biases(self) -> int:
        """Bias values of one routed expert: its MLP's input projection(s) and output, with linear_bias."""
        return (self.mlp_matrices - 1) * self.ffn_hidden_size + self.hidden_size if self.linear_bias else 0

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
        expert_width = self.experts_per_token * self.ffn_hidden_size + self.shared_expert_ffn_hidden_size
        if not self.dense_layers:
            return expert_width
        # The mean over the layers: every stage is priced as that many mean layers (see the class docstring).
        return (self.expert_layers * expert_width + self.dense_layers * self.dense_ffn_hidden_size) / self.num_layers

    @property
    def routed_expert_params_per_layer(self) -> int:
        """Weights of one layer's routed experts, biases included (0 for a dense model): what expert
        parallelism shards."""
        if not self.is_moe:
            return 0
        return self.num_experts * (self.mlp_matrices * self.hidden_size * self.ffn_hidden_size + self.expert_biases)

    @property
    def head_width(self) -> int:
        """Each attention head's width: `head_dim`, or hidden_size / num_attention_heads."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def qk_head_width(self) -> int:
        """Each head's query (and key) width: `head_width`, plus the shared rotary part with latent attention."""
        return self.head_width + self.qk_rope_head_dim

    @property
    def q_width(self) -> int:
        """Output width of the Q projection."""
        return self.num_attention_heads * self.qk_head_width

    @property
    def attention_output_width(self) -> int:
        """Width of the attention's output (scores x V), the input of its output projection: q_width except
        with latent attention's `v_head_dim`."""
        return self.num_attention_heads * (self.v_head_dim or self.head_width)

    @property
    def key_width(self) -> int:
        """Width of one token's keys over all KV heads (what the attention core reads)."""
        return self.num_kv_heads * self.qk_head_width

    @property
    def value_width(self) -> int:
        return self.num_kv_heads * (self.v_head_dim or self.head_width)

    @property
    def kv_width(self) -> float:
        """Output width of the K (or V) projection; with latent attention the mean of the key and value widths
        the up-projection makes."""
        if not self.is_mla:
            return self.num_kv_heads * self.head_width
        return (self.key_width + self.value_width) / 2

    @property
    def attention_params(self) -> int:
        """Weights of one layer's attention projections (and latent attention's latent norms), no biases."""
        h = self.hidden_size
        if not self.is_mla:
            return h * (self.q_width + 2 * self.kv_width) + self.q_width * h
        q = self.q_lora_rank * (h + 1 + self.q_width) if self.q_lora_rank else h * self.q_width
        kv_up = self.kv_lora_rank * self.num_attention_heads * (self.head_width + (self.v_head_dim or self.head_width))
        kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank + kv_up
        return q + kv + self.attention_output_width * h

    @property
    def norm_params(self) -> int:
        """Weights of one normalization: RMSNorm a scale, LayerNorm a scale and a shift."""
        return (2 if self.normalization == LAYERNORM else 1) * self.hidden_size

    @property
    def params_per_layer(self) -> int:
        """Weights of one transformer layer: the matrices, their biases where the model has them, two norms."""
        h, f = self.hidden_size, self.ffn_hidden_size
        qkv_width = self.q_width + 2 * self.kv_width
        attention = self.attention_params + (2 * self.head_width if self.qk_norm else 0)
        mlp_matrices = self.mlp_matrices
        mlp = mlp_matrices * h * f
        if self.is_moe:  # the router, every routed expert (biases and all) and the shared experts
            mlp = h * self.num_experts + self.routed_expert_params_per_layer
            mlp += mlp_matrices * h * self.shared_expert_ffn_hidden_size
        biases = 0
        if self.qkv_bias or self.linear_bias:
            biases += qkv_width
        if self.linear_bias:
            biases += h  # the attention output's
            if not self.is_moe:  # the MLP's input projection(s) (gate and up for SwiGLU) and its output
                biases += (mlp_matrices - 1) * f + h
            else:  # the router's, and the shared experts' MLP (the routed experts' are counted with them)
                biases += self.num_experts
                if self.shared_expert_ffn_hidden_size:
                    biases += (mlp_matrices - 1) * self.shared_expert_ffn_hidden_size + h
        sinks = self.num_attention_heads if self.attention_sinks else 0
        return attention + mlp + biases + sinks + 2 * self.norm_params

    @property
    def dense_layer_params(self) -> int:
        """Weights of one of the first `dense_layers` layers: an expert layer's attention and norms with a
        dense MLP of `dense_ffn_hidden_size` (0 without dense layers)."""
        if not self.dense_layers:
            return 0
        expert_mlp = self.hidden_size * self.num_experts + self.routed_expert_params_per_layer + (
            self.mlp_matrices * self.hidden_size * self.shared_expert_ffn_hidden_size)
        return self.params_per_layer - expert_mlp + self.mlp_matrices * self.hidden_size * self.dense_ffn_hidden_size

    @property
    def layer_params(self) -> int:
        """Weights of all transformer layers together."""
        return self.expert_layers * self.params_per_layer + (self.num_layers - self.expert_layers) * (
            self.dense_layer_params or self.params_per_layer)

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
        return self.layer_params + self.embedding_params + head + self.norm_params + self.mtp_params

    @property
    def mtp_params(self) -> int:
        """Weights of the multi-token-prediction depths (the embedding and head they share are not counted again)."""
        return self.mtp_layers * (self.params_per_layer + 2 * self.hidden_size * self.hidden_size + 3 * self.norm_params)

    @property
    def active_params(self) -> int:
        """Weights one token runs through: `total_params` less the routed experts it skips (the figure
        mixture-of-experts models publish as "active")."""
        skipped = self.num_experts - self.experts_per_token if self.is_moe else 0
        per_expert = self.mlp_matrices * self.hidden_size * self.ffn_hidden_size + self.expert_biases
        expert_layers = self.expert_layers + (self.mtp_layers if self.is_moe else 0)
        return self.total_params - expert_layers * skipped * per_expert


def model_preset_names() -> list[str]:
    return sorted(preset_table("models.json"))


def model_preset(name: str) -> ModelSpec:
    """The preset model called `name`; KeyError if there is none."""
    fields = dict(preset_table("models.json")[name])
    scaling = fields.pop("rope_scaling", None)
    return ModelSpec(name=name, rope_scaling=RopeScaling(**scaling) if scaling else None, **fields)
