"""The plan's model as torchtitan 0.3 builds it: a Llama3Model.Config with exactly the plan's architecture.

torchtitan picks its model in Python (`--module M --config C` names a config_registry function); the
command line cannot change the model's shape. For a model torchtitan has no config function of its
own for, write one that takes this spec:

    from adapters.torchtitan_model import llama3_model_spec
    from torchtitan.models.llama3.config_registry import llama3_8b

    def my_model() -> Trainer.Config:          # in your_module/config_registry.py
        config = llama3_8b()                   # optimizer, data, checkpointing: yours to choose
        config.model_spec = llama3_model_spec(plan.architecture)
        return config

and start it with `--module your_module --config my_model` (an FP8 plan: `llama3_model_spec(plan.architecture,
float8=True)`, torchtitan's float8 converter on every layer's Linear). The spec is torchtitan's llama3 spec
(its parallelize and pipelining functions) with the layers built by torchtitan's own llama3 layer
builder and set to the plan's widths, GQA heads, RMSNorm epsilon, RoPE base and Llama 3.1 scaling,
biases and weight tying.

Refused (ExportError): what torchtitan's Llama3 decoder does not build: LayerNorm, learned absolute
positions, a non-gated MLP, partial rotary embeddings.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from adapters.registry import ExportError
from wire.schemas import ModelArchitecture

TARGET = "torchtitan"
# the context torchtitan's own llama3 configs precompute RoPE frequencies for
ROPE_MAX_SEQ_LEN = 131_072


def unsupported(arch: ModelArchitecture) -> list[str]:
    """What torchtitan's Llama3 decoder cannot build of `arch` (empty when it builds it exactly)."""
    problems = []
    if arch.normalization != "rmsnorm":
        problems.append(f"{arch.normalization} (its Llama3 decoder normalizes with RMSNorm)")
    if arch.position_embedding != "rope":
        problems.append("learned absolute positions (it has RoPE only)")
    if not arch.swiglu:
        problems.append("a non-gated MLP (its FeedForward is SwiGLU)")
    if arch.rotary_percent != 1.0:
        problems.append(f"RoPE on {arch.rotary_percent:.0%} of each head (it rotates all of it)")
    if arch.head_dim is not None or arch.qk_norm:
        problems.append("heads apart from hidden / heads wide, or query/key norms (its Llama3 attention has neither)")
    if arch.num_experts:
        problems.append(f"a mixture of {arch.num_experts} experts (its Llama3 decoder is dense; resiplan does not "
                        "export torchtitan's MoE models yet: export to Megatron-LM instead)")
    return problems


def llama3_model_config(arch: ModelArchitecture) -> Any:
    """torchtitan's Llama3Model.Config for `arch`; ExportError naming what torchtitan cannot build."""
    problems = unsupported(arch)
    if problems:
        raise ExportError(f"{TARGET} cannot build this model: {'; '.join(problems)}")
    # torchtitan's own llama3 layer builder and initializers (private names of torchtitan.models.llama3,
    # which its 1B..405B configs are made of; tests/adapters/test_model_exports.py builds the result)
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _EMBEDDING_SKIP_INIT,
        _NORM_INIT,
        _build_llama3_layers,
        _output_linear_init,
    )
    from torchtitan.models.llama3.model import Llama3Model

    dim, vocab = arch.hidden_size, arch.vocab_size
    scaling = arch.rope_scaling
    rope = ComplexRoPE.Config(
        dim=dim // arch.num_attention_heads,
        max_seq_len=ROPE_MAX_SEQ_LEN,
        theta=arch.rope_theta,
        scaling="llama" if scaling is not None else "none",
        **({} if scaling is None else {
            "scaling_factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        }),
    )
    layers = _build_llama3_layers(
        n_layers=arch.num_layers, dim=dim, n_heads=arch.num_attention_heads,
        n_kv_heads=arch.num_kv_heads or arch.num_attention_heads, hidden_dim=arch.ffn_hidden_size,
        rope=rope, fuse_qkv=True, attn_backend="flex",
    )
    for layer in layers:
        _set_norms_and_biases(layer, arch)
    return Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        enable_weight_tying=arch.tied_embeddings,
        # tied: the output projection's initializer sets the shared table (as torchtitan's 1B and 3B do)
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=_EMBEDDING_SKIP_INIT if arch.tied_embeddings else _EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, eps=arch.norm_epsilon, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=layers,
    )


def llama3_model_spec(arch: ModelArchitecture, float8: bool = False, emulate: bool = False) -> Any:
    """torchtitan's llama3 ModelSpec (parallelize, pipelining, state-dict adapter) with `arch`'s model.

    float8: the plan trains in FP8 (`training.precision: "fp8"`): torchtitan's own Float8LinearConverter
    swaps the transformer layers' Linear configs for torchao's Float8Linear, the output head kept in bf16
    as the plan prices it (torchtitan's llama3_405b config does the same). It needs an SM89+ GPU;
    `emulate` runs torchao's emulation instead (CPU tests only)."""
    from torchtitan.models.llama3 import model_registry

    spec = model_registry("debugmodel")
    model = llama3_model_config(arch)
    if float8:
        from torchtitan.components.quantization.float8 import Float8LinearConverter

        converter = Float8LinearConverter.Config(filter_fqns=["lm_head"], emulate=emulate,
                                                 model_compile_enabled=not emulate)
        model = converter.build().convert(model)
    return dataclasses.replace(spec, flavor=f"resiplan:{arch.name}", model=model)


def _set_norms_and_biases(layer: Any, arch: ModelArchitecture) -> None:
    layer.attention_norm.eps = layer.ffn_norm.eps = arch.norm_epsilon
    layer.attention.qkv_linear.wqkv.bias = arch.qkv_bias or arch.linear_bias
    layer.attention.wo.bias = arch.linear_bias
    for linear in (layer.feed_forward.w1, layer.feed_forward.w2, layer.feed_forward.w3):
        linear.bias = arch.linear_bias
