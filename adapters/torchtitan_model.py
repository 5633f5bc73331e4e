"""The plan's model as torchtitan 0.3 builds it: a Llama3Model.Config, Qwen3Model.Config, GptOssModel.Config or
DeepSeekV3Model.Config with exactly the plan's architecture.

torchtitan picks its model in Python (`--module M --config C` names a config_registry function); the
command line cannot change the model's shape. For a model torchtitan has no config function of its
own for, write one that takes this spec:

    from adapters.torchtitan_model import model_spec
    from torchtitan.models.llama3.config_registry import llama3_8b

    def my_model() -> Trainer.Config:          # in your_module/config_registry.py
        config = llama3_8b()                   # optimizer, data, checkpointing: yours to choose
        config.model_spec = model_spec(plan.architecture)
        return config

and start it with `--module your_module --config my_model` (an FP8 plan: `model_spec(plan.architecture,
float8=True)`, torchtitan's float8 converter on every layer's Linear).

Which torchtitan model (`model_family`):
- llama3: a dense decoder without query/key norms. torchtitan's llama3 spec (its parallelize and
  pipelining functions) with the layers built by torchtitan's own llama3 layer builder and set to the
  plan's widths, GQA heads, RMSNorm epsilon, RoPE base and Llama 3.1 scaling, biases and weight tying.
- qwen3: per-head query/key RMSNorms (`qk_norm`), dense or a mixture of experts. torchtitan's qwen3 spec
  (its parallelize function applies expert parallelism) with the layers built by its own Qwen3 builders:
  heads `head_dim` wide, and for a mixture of experts its softmax top-k router (probabilities
  renormalized over the k chosen, as Qwen3-MoE's `norm_topk_prob`) over `num_experts` routed experts
  of width `ffn_hidden_size`.

- deepseek_v3: multi-head latent attention. torchtitan's DeepSeek-V3 spec with the layers built by its own
  DeepSeek-V3 builder: the query and key/value latents, the first `dense_layers` layers dense, then routed
  experts with `shared_expert_ffn_hidden_size / ffn_hidden_size` shared ones, YaRN applied as its softmax
  temperature (`mscale`); the router is its softmax top-k (`deepseek_v3_model_config`).

Refused (ExportError): what those decoders do not build: LayerNorm, learned absolute positions, a
non-gated MLP, partial rotary embeddings; heads of their own width without query/key norms; for qwen3,
RoPE scaling, biases and shared experts; a mixture of experts without query/key norms (Mixtral,
Qwen2-MoE: torchtitan has no config of theirs; export them to Megatron-LM).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from adapters.registry import ExportError
from wire.schemas import ModelArchitecture

TARGET = "torchtitan"
# the context torchtitan's own llama3 configs precompute RoPE frequencies for
ROPE_MAX_SEQ_LEN = 131_072


LLAMA3, QWEN3, GPT_OSS, DEEPSEEK_V3 = "llama3", "qwen3", "gpt_oss", "deepseek_v3"
# torchtitan's expert communication: its all-to-all ("standard", what training.moe_dispatcher alltoall prices)
# and DeepEP's kernels (what moe_dispatcher flex prices)
STANDARD, DEEPEP = "standard", "deepep"


def comm_backend(moe_dispatcher: str | None) -> str:
    """torchtitan's moe_comm_backend for a plan's training.moe_dispatcher."""
    return DEEPEP if moe_dispatcher == "flex" else STANDARD
# What torchtitan 0.3's GPT-OSS layer builder fixes: its attention's heads and the window on every other layer.
GPT_OSS_ATTENTION = {"num_attention_heads": 64, "num_kv_heads": 8, "head_dim": 64, "sliding_window": 128,
                     "full_attention_every": 2}


def model_family(arch: ModelArchitecture) -> str:
    """The torchtitan model that builds `arch`: deepseek_v3 for latent attention, gpt_oss where attention has
    sinks, qwen3 where heads carry query/key norms, else llama3."""
    if arch.kv_lora_rank:
        return DEEPSEEK_V3
    if arch.attention_sinks:
        return GPT_OSS
    return QWEN3 if arch.qk_norm else LLAMA3


def unsupported(arch: ModelArchitecture) -> list[str]:
    """What torchtitan's decoder for `arch` (`model_family`) cannot build of it (empty when it builds it
    exactly)."""
    family = model_family(arch)
    if family == GPT_OSS:
        return _gpt_oss_problems(arch)
    if family == DEEPSEEK_V3:
        return _deepseek_problems(arch)
    if arch.mtp_layers:
        return ["multi-token prediction (torchtitan builds it in its DeepSeek-V3 model only)"]
    decoder = "Llama3" if family == LLAMA3 else "Qwen3"
    problems = []
    if arch.sliding_window is not None:
        problems.append(f"sliding-window attention (its {decoder} attention sees the whole sequence)")
    if arch.rope_scaling is not None and arch.rope_scaling.rope_type == "yarn":
        problems.append(f"YaRN RoPE scaling (its {decoder} RoPE is Llama 3.1-scaled or unscaled)")
    if arch.normalization != "rmsnorm":
        problems.append(f"{arch.normalization} (its {decoder} decoder normalizes with RMSNorm)")
    if arch.position_embedding != "rope":
        problems.append("learned absolute positions (it has RoPE only)")
    if not arch.swiglu:
        problems.append("a non-gated MLP (its FeedForward is SwiGLU)")
    if arch.rotary_percent != 1.0:
        problems.append(f"RoPE on {arch.rotary_percent:.0%} of each head (it rotates all of it)")
    if family == LLAMA3:
        if arch.head_dim is not None:
            problems.append("heads apart from hidden / heads wide without query/key norms (its Llama3 attention "
                            "has heads hidden / heads wide; its Qwen3 one, of any width, has the norms)")
        if arch.num_experts:
            problems.append(f"a mixture of {arch.num_experts} experts without query/key norms (torchtitan builds "
                            "Qwen3's mixtures, not this one: export to Megatron-LM instead)")
        return problems
    if arch.rope_scaling is not None:
        problems.append("RoPE scaling (its Qwen3 RoPE is unscaled)")
    if arch.qkv_bias or arch.linear_bias:
        problems.append("biases on the projections (its Qwen3 layers have none)")
    if arch.shared_expert_ffn_hidden_size:
        problems.append("shared experts (its Qwen3 mixture of experts has routed experts only)")
    return problems


def _gpt_oss_problems(arch: ModelArchitecture) -> list[str]:
    """What torchtitan's GPT-OSS builder cannot build of `arch`: it builds GPT-OSS's attention (64 heads of
    64, 8 KV heads, a 128-token window on every other layer) and biased SwiGLU experts."""
    problems = []
    head_dim = arch.head_dim or arch.hidden_size // arch.num_attention_heads
    attention = {"num_attention_heads": arch.num_attention_heads, "num_kv_heads": arch.num_kv_heads or
                 arch.num_attention_heads, "head_dim": head_dim, "sliding_window": arch.sliding_window,
                 "full_attention_every": arch.full_attention_every}
    if attention != GPT_OSS_ATTENTION:
        problems.append(f"attention other than GPT-OSS's {GPT_OSS_ATTENTION} (its GPT-OSS builder fixes it), "
                        f"this model's is {attention}")
    if not arch.num_experts or not arch.linear_bias or arch.shared_expert_ffn_hidden_size:
        problems.append("an MLP other than GPT-OSS's routed, biased experts")
    if arch.normalization != "rmsnorm" or arch.position_embedding != "rope" or not arch.swiglu or arch.qk_norm:
        problems.append("norms, positions or activations other than GPT-OSS's")
    if arch.rotary_percent != 1.0 or (arch.rope_scaling is not None and arch.rope_scaling.rope_type != "yarn"):
        problems.append("RoPE other than GPT-OSS's (all of each head, YaRN-scaled or not)")
    return problems


def _deepseek_problems(arch: ModelArchitecture) -> list[str]:
    """What torchtitan's DeepSeek-V3 builder cannot build of `arch`: it builds latent attention over RMSNorm
    layers with SwiGLU, dense layers first, then routed experts with shared ones of the experts' width."""
    problems = []
    if not arch.num_experts or not arch.shared_expert_ffn_hidden_size or (
            arch.shared_expert_ffn_hidden_size % arch.ffn_hidden_size):
        problems.append("an MLP other than DeepSeek's routed experts with shared experts of the same width")
    if arch.normalization != "rmsnorm" or arch.position_embedding != "rope" or not arch.swiglu:
        problems.append("norms, positions or activations other than DeepSeek's")
    scaling = arch.rope_scaling
    if arch.rotary_percent != 1.0 or (scaling is not None and (
            scaling.rope_type != "yarn" or scaling.mscale is None or scaling.mscale != scaling.mscale_all_dim)):
        problems.append("RoPE other than DeepSeek's (plain, or YaRN with mscale equal to mscale_all_dim, which its "
                        "attention applies as its softmax temperature)")
    return problems


def deepseek_v3_model_config(arch: ModelArchitecture, moe_comm_backend: str = STANDARD) -> Any:
    """torchtitan's DeepSeekV3Model.Config for `arch`, built by its own layer builder; ExportError naming what it
    cannot build. The router is torchtitan's softmax top-k (no expert groups, no route scale): routing changes
    no weight and no cost, and a recipe that routes as DeepSeek-V3 does (sigmoid scores, 8 groups of which 4,
    scale 2.5) sets those fields of each layer's `moe.router`."""
    _refuse_unbuildable(arch, DEEPSEEK_V3, "no latent attention (not a DeepSeek model)")
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.deepseek_v3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        _build_dsv3_layers,
        _build_mtp_layers,
        _output_linear_init,
    )
    from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

    dim, vocab, scaling = arch.hidden_size, arch.vocab_size, arch.rope_scaling
    rope = ComplexRoPE.Config(
        dim=arch.qk_rope_head_dim, max_seq_len=ROPE_MAX_SEQ_LEN, theta=arch.rope_theta,
        **({"scaling": "none"} if scaling is None else {
            "scaling": "yarn", "rope_factor": scaling.factor, "beta_fast": scaling.beta_fast,
            "beta_slow": scaling.beta_slow, "original_seq_len": scaling.original_max_position_embeddings}))
    layers = _build_dsv3_layers(
        n_layers=arch.num_layers, n_dense_layers=arch.dense_layers, dim=dim, n_heads=arch.num_attention_heads,
        q_lora_rank=arch.q_lora_rank, kv_lora_rank=arch.kv_lora_rank, qk_nope_head_dim=arch.head_dim,
        qk_rope_head_dim=arch.qk_rope_head_dim, v_head_dim=arch.v_head_dim or arch.head_dim,
        mscale=1.0 if scaling is None else scaling.mscale, dense_hidden_dim=arch.dense_ffn_hidden_size or 1,
        moe_hidden_dim=arch.ffn_hidden_size, num_experts=arch.num_experts,
        num_shared_experts=arch.shared_expert_ffn_hidden_size // arch.ffn_hidden_size,
        router_top_k=arch.experts_per_token, router_score_func="softmax", attn_backend="flex",
        moe_comm_backend=moe_comm_backend, non_blocking_capacity_factor=None, rope=rope)
    for layer in layers:
        layer.attention_norm.eps = layer.ffn_norm.eps = arch.norm_epsilon
        layer.attention.kv_norm.eps = layer.attention.q_norm.eps = arch.norm_epsilon
    return DeepSeekV3Model.Config(
        vocab_size=vocab, dim=dim, enable_weight_tying=arch.tied_embeddings,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, eps=arch.norm_epsilon, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=layers,
        # its multi-token-prediction depths, each built from the last layer's config as its own configs do
        mtp_layers=_build_mtp_layers(layers[-1], dim=dim, num_mtp_layers=arch.mtp_layers),
    )


def model_config(arch: ModelArchitecture, moe_comm_backend: str = STANDARD) -> Any:
    """torchtitan's model config for `arch` (Llama3Model.Config, Qwen3Model.Config, GptOssModel.Config or
    DeepSeekV3Model.Config, by `model_family`); ExportError naming what torchtitan cannot build."""
    family = model_family(arch)
    if family == DEEPSEEK_V3:
        return deepseek_v3_model_config(arch, moe_comm_backend)
    if family == GPT_OSS:
        return gpt_oss_model_config(arch, moe_comm_backend)
    return qwen3_model_config(arch, moe_comm_backend) if family == QWEN3 else llama3_model_config(arch)


def gpt_oss_model_config(arch: ModelArchitecture, moe_comm_backend: str = STANDARD) -> Any:
    """torchtitan's GptOssModel.Config for `arch`; ExportError naming what its GPT-OSS builder cannot build."""
    _refuse_unbuildable(arch, GPT_OSS, "no attention sinks (not a GPT-OSS model)")
    # torchtitan's own GPT-OSS layer builder (private names of torchtitan.models.gpt_oss, which its 20b and 120b
    # configs are made of; tests/adapters/test_model_exports.py builds the result)
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.gpt_oss import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        _build_gptoss_layers,
        _output_linear_init,
    )
    from torchtitan.models.gpt_oss.model import GptOssModel

    dim, vocab = arch.hidden_size, arch.vocab_size
    scaling = arch.rope_scaling
    rope = CosSinRoPE.Config(
        dim=GPT_OSS_ATTENTION["head_dim"], max_seq_len=ROPE_MAX_SEQ_LEN, theta=arch.rope_theta,
        **({} if scaling is None else {
            "scaling": "yarn", "rope_factor": scaling.factor, "beta_fast": scaling.beta_fast,
            "beta_slow": scaling.beta_slow, "truncate": False,
            "original_seq_len": scaling.original_max_position_embeddings}),
    )
    layers = _build_gptoss_layers(dim=dim, n_layers=arch.num_layers, hidden_dim=arch.ffn_hidden_size,
                                  num_experts=arch.num_experts, top_k=arch.experts_per_token, load_balance_coeff=1e-3,
                                  moe_comm_backend=moe_comm_backend, rope=rope)
    for layer in layers:
        layer.attention_norm.eps = layer.ffn_norm.eps = arch.norm_epsilon
    norm = RMSNorm.Config(normalized_shape=dim, eps=arch.norm_epsilon, param_init=_NORM_INIT)
    return GptOssModel.Config(
        dim=dim, vocab_size=vocab, enable_weight_tying=arch.tied_embeddings, norm=norm,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=layers,
    )


def model_spec(arch: ModelArchitecture, float8: bool = False, emulate: bool = False,
               moe_comm_backend: str = STANDARD) -> Any:
    """torchtitan's ModelSpec for `arch`: llama3's or qwen3's (parallelize, pipelining, state-dict
    adapter), with the plan's model. float8 and emulate as in `llama3_model_spec`; a mixture of experts in
    FP8 is refused (torchtitan's float8 converter swaps Linear layers; its grouped experts would stay in
    bf16, which the plan did not price). moe_comm_backend: `comm_backend(plan.moe_dispatcher)`, DeepEP's kernels
    for a plan priced with the flex dispatcher."""
    family = model_family(arch)
    if family == LLAMA3:
        return llama3_model_spec(arch, float8=float8, emulate=emulate)
    if float8 and arch.num_experts:
        raise ExportError(f"{TARGET} cannot train this plan as priced: fp8 with a mixture of experts (its float8 "
                          "converter leaves the grouped experts in bf16); plan it in bf16")
    if family == DEEPSEEK_V3:
        from torchtitan.models.deepseek_v3 import model_registry as deepseek_registry

        spec = deepseek_registry("debugmodel")
        return dataclasses.replace(spec, flavor=f"resiplan:{arch.name}", model=deepseek_v3_model_config(arch, moe_comm_backend))
    if family == GPT_OSS:
        from torchtitan.models.gpt_oss import model_registry as gpt_oss_registry

        spec = gpt_oss_registry("debugmodel")
        return dataclasses.replace(spec, flavor=f"resiplan:{arch.name}", model=gpt_oss_model_config(arch, moe_comm_backend))
    from torchtitan.models.qwen3 import model_registry

    spec = model_registry("debugmodel_moe" if arch.num_experts else "debugmodel")
    return dataclasses.replace(spec, flavor=f"resiplan:{arch.name}", model=_float8(
        qwen3_model_config(arch, moe_comm_backend), float8, emulate))


def _refuse_unbuildable(arch: ModelArchitecture, family: str, other_family: str) -> None:
    """ExportError naming what `family`'s decoder cannot build of `arch` (`other_family`: why an
    architecture of the other family is not one)."""
    problems = unsupported(arch) if model_family(arch) == family else [other_family]
    if problems:
        raise ExportError(f"{TARGET} cannot build this model: {'; '.join(problems)}")


def qwen3_model_config(arch: ModelArchitecture, moe_comm_backend: str = STANDARD) -> Any:
    """torchtitan's Qwen3Model.Config for `arch`, dense or a mixture of experts; ExportError naming what
    its Qwen3 decoder cannot build."""
    _refuse_unbuildable(arch, QWEN3, "no query/key norms (not a Qwen3 model)")
    # torchtitan's own Qwen3 layer builders and initializers (private names of torchtitan.models.qwen3,
    # which its 0.6B..235B-A22B configs are made of; tests/adapters/test_model_exports.py builds the result)
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (
        _EMBEDDING_INIT,
        _EMBEDDING_SKIP_INIT,
        _LINEAR_INIT,
        _build_qwen3_layers,
        _build_qwen3_moe_layers,
        _qwen3_norm,
    )
    from torchtitan.models.qwen3.model import Qwen3Model

    dim, vocab = arch.hidden_size, arch.vocab_size
    head_dim = arch.head_dim or dim // arch.num_attention_heads
    common = dict(n_layers=arch.num_layers, dim=dim, n_heads=arch.num_attention_heads,
                  n_kv_heads=arch.num_kv_heads or arch.num_attention_heads, head_dim=head_dim, fuse_qkv=True,
                  attn_backend="flex",
                  rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=ROPE_MAX_SEQ_LEN, theta=arch.rope_theta))
    if arch.num_experts:
        layers = _build_qwen3_moe_layers(**common, moe_hidden_dim=arch.ffn_hidden_size, num_experts=arch.num_experts,
                                         top_k=arch.experts_per_token, moe_comm_backend=moe_comm_backend)
    else:
        layers = _build_qwen3_layers(**common, hidden_dim=arch.ffn_hidden_size)
    for layer in layers:
        layer.attention_norm.eps = layer.ffn_norm.eps = layer.attention.qk_norm.eps = arch.norm_epsilon
    norm = _qwen3_norm(dim)
    norm.eps = arch.norm_epsilon
    return Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=norm,
        enable_weight_tying=arch.tied_embeddings,
        # tied: the output projection's initializer sets the shared table (as torchtitan's 0.6B..4B do)
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=_EMBEDDING_SKIP_INIT if arch.tied_embeddings else _EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
        layers=layers,
    )


def llama3_model_config(arch: ModelArchitecture) -> Any:
    """torchtitan's Llama3Model.Config for `arch`; ExportError naming what torchtitan cannot build."""
    _refuse_unbuildable(arch, LLAMA3, "query/key norms (its Llama3 attention has none)")
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
    return dataclasses.replace(spec, flavor=f"resiplan:{arch.name}",
                               model=_float8(llama3_model_config(arch), float8, emulate))


def _float8(model: Any, float8: bool, emulate: bool) -> Any:
    """`model` with torchtitan's Float8LinearConverter applied when `float8` (the head kept in bf16)."""
    if not float8:
        return model
    from torchtitan.components.quantization.float8 import Float8LinearConverter

    converter = Float8LinearConverter.Config(filter_fqns=["lm_head"], emulate=emulate,
                                             model_compile_enabled=not emulate)
    return converter.build().convert(model)


def _set_norms_and_biases(layer: Any, arch: ModelArchitecture) -> None:
    layer.attention_norm.eps = layer.ffn_norm.eps = arch.norm_epsilon
    layer.attention.qkv_linear.wqkv.bias = arch.qkv_bias or arch.linear_bias
    layer.attention.wo.bias = arch.linear_bias
    for linear in (layer.feed_forward.w1, layer.feed_forward.w2, layer.feed_forward.w3):
        linear.bias = arch.linear_bias
