"""Presets against published configs, parameter counts by hand, HF config parsing."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_models.hf_config import HfConfigError, model_from_hf_config
from cost_models.model_spec import (
    ARCHITECTURE_LIMITS,
    MAX_MODEL_NAME_CHARS,
    ModelSpec,
    RopeScaling,
    model_preset,
    model_preset_names,
)


@pytest.mark.parametrize(
    "name,L,h,f,a,kv,V,swiglu,tied",
    [
        # meta-llama/Llama-2-70b-hf config.json
        ("llama2-70b", 80, 8192, 28672, 64, 8, 32000, True, False),
        # meta-llama/Llama-2-7b-hf
        ("llama2-7b", 32, 4096, 11008, 32, 32, 32000, True, False),
        # meta-llama/Meta-Llama-3-8B
        ("llama3-8b", 32, 4096, 14336, 32, 8, 128256, True, False),
        # Qwen/Qwen2.5-72B
        ("qwen2.5-72b", 80, 8192, 29568, 64, 8, 152064, True, False),
        # GPT-3 175B (Brown et al. 2020, Table 2.1): 96 layers, d_model 12288, 96 heads, ffn 4 d_model
        ("gpt3-175b", 96, 12288, 49152, 96, 96, 50257, False, True),
    ],
)
def test_presets_match_published(name, L, h, f, a, kv, V, swiglu, tied):
    assert name in model_preset_names()
    m = model_preset(name)
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size) == (L, h, f)
    assert (m.num_attention_heads, m.num_kv_heads, m.vocab_size) == (a, kv, V)
    assert (m.swiglu, m.tied_embeddings) == (swiglu, tied)


def test_unknown_preset_raises_key_error():
    with pytest.raises(KeyError):
        model_preset("no-such-model")


def test_llama2_7b_params_per_layer():
    h, f = 4096, 11008
    # Q, K, V, O: 4 h^2; gate, up, down: 3 h f; two RMSNorm weights: 2 h
    expected = 4 * h**2 + 3 * h * f + 2 * h
    assert expected == 202_383_360  # 67,108,864 + 135,266,304 + 8,192
    assert model_preset("llama2-7b").params_per_layer == expected


def test_llama2_70b_params_per_layer_with_gqa():
    h, f, kv_width = 8192, 28672, 8 * 128
    # Q and O: 2 h^2; K and V: 2 h * kv_width; SwiGLU 3 h f; norms 2 h
    expected = 2 * h**2 + 2 * h * kv_width + 3 * h * f + 2 * h
    assert model_preset("llama2-70b").params_per_layer == expected


@pytest.mark.parametrize(
    "name,published,rel",
    [
        ("llama2-7b", 6.74e9, 0.01),  # Touvron et al. 2023: 6,738,415,616
        ("llama2-70b", 69.0e9, 0.015),
        ("llama3-8b", 8.03e9, 0.01),
        ("qwen2.5-72b", 72.7e9, 0.01),  # Qwen2.5 report: 72.7B
        ("gpt3-175b", 175e9, 0.01),
        ("qwen3-8b", 8.2e9, 0.005),  # Qwen/Qwen3-8B model card: 8.2B
        ("qwen3-32b", 32.8e9, 0.005),  # Qwen/Qwen3-32B model card: 32.8B
    ],
)
def test_total_params_match_published(name, published, rel):
    assert model_preset(name).total_params == pytest.approx(published, rel=rel)


def test_llama2_7b_total_params_exact():
    h, f, L, V = 4096, 11008, 32, 32000
    # layers + input embedding + untied output head + final norm
    expected = L * (4 * h**2 + 3 * h * f + 2 * h) + V * h + V * h + h
    assert expected == 6_738_415_616  # the published Llama-2-7b parameter count
    assert model_preset("llama2-7b").total_params == expected


def test_tied_embeddings_count_once():
    h, V, L, positions = 12288, 50257, 96, 2048
    # GPT-3 (Brown et al. 2020): 4h^2 attention + 8h^2 MLP, biases on QKV (3h), output (h), MLP (4h + h),
    # two LayerNorms (weight and bias, 4h); token and learned position tables; a final LayerNorm (2h)
    expected = L * (12 * h**2 + 9 * h + 4 * h) + V * h + positions * h + 2 * h
    assert model_preset("gpt3-175b").total_params == expected


# Verbatim fields of meta-llama/Meta-Llama-3-8B/config.json
LLAMA3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}

# Verbatim fields of openai-community/gpt2/config.json
GPT2_CONFIG = {
    "activation_function": "gelu_new",
    "architectures": ["GPT2LMHeadModel"],
    "attn_pdrop": 0.1,
    "bos_token_id": 50256,
    "embd_pdrop": 0.1,
    "eos_token_id": 50256,
    "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05,
    "model_type": "gpt2",
    "n_ctx": 1024,
    "n_embd": 768,
    "n_head": 12,
    "n_layer": 12,
    "n_positions": 1024,
    "resid_pdrop": 0.1,
    "summary_activation": None,
    "summary_first_dropout": 0.1,
    "summary_proj_to_labels": True,
    "summary_type": "cls_index",
    "summary_use_proj": True,
    "vocab_size": 50257,
}


def test_hf_llama_config():
    m = model_from_hf_config(LLAMA3_8B_CONFIG)
    assert isinstance(m, ModelSpec)
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size) == (32, 4096, 14336)
    assert (m.num_attention_heads, m.num_kv_heads, m.vocab_size) == (32, 8, 128256)
    assert m.swiglu is True  # silu + intermediate_size: gated MLP
    assert m.tied_embeddings is False
    # same architecture as the preset
    preset = model_preset("llama3-8b")
    assert m.total_params == preset.total_params == 8_030_261_248


def test_hf_gpt2_config():
    m = model_from_hf_config(GPT2_CONFIG)
    assert (m.num_layers, m.hidden_size, m.num_attention_heads) == (12, 768, 12)
    assert m.num_kv_heads == 12  # no GQA field: one kv head per query head
    assert m.ffn_hidden_size == 4 * 768  # n_inner absent: 4h
    assert m.swiglu is False
    assert m.vocab_size == 50257
    assert m.tied_embeddings is True  # GPT-2 ties wte and lm_head (HF default)
    assert (m.normalization, m.norm_epsilon) == ("layernorm", 1e-5)
    assert (m.position_embedding, m.max_position_embeddings) == ("learned", 1024)
    assert m.linear_bias is True
    # GPT-2 small as published: GPT2LMHeadModel("gpt2").num_parameters() == 124,439,808
    assert m.total_params == 124_439_808


def test_hf_gpt2_with_explicit_n_inner():
    m = model_from_hf_config({**GPT2_CONFIG, "n_inner": 2048})
    assert m.ffn_hidden_size == 2048 and m.swiglu is False


# Verbatim fields of EleutherAI/pythia-1b/config.json (GPT-NeoX: intermediate_size but GELU)
PYTHIA_1B_CONFIG = {
    "architectures": ["GPTNeoXForCausalLM"],
    "bos_token_id": 0,
    "eos_token_id": 0,
    "hidden_act": "gelu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "layer_norm_eps": 1e-05,
    "max_position_embeddings": 2048,
    "model_type": "gpt_neox",
    "num_attention_heads": 8,
    "num_hidden_layers": 16,
    "rotary_emb_base": 10000,
    "rotary_pct": 0.25,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "use_cache": True,
    "use_parallel_residual": True,
    "vocab_size": 50304,
}


def test_hf_gelu_with_intermediate_size_is_not_gated():
    m = model_from_hf_config(PYTHIA_1B_CONFIG)
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads) == (16, 2048, 8192, 8)
    assert m.swiglu is False  # GPT-NeoX MLP: dense_h_to_4h, GELU, dense_4h_to_h
    assert m.tied_embeddings is False
    assert (m.normalization, m.linear_bias, m.position_embedding) == ("layernorm", True, "rope")
    assert m.rotary_percent == 0.25
    # EleutherAI/pythia-1b as published (GPTNeoXForCausalLM.num_parameters(), biases included)
    assert m.total_params == 1_011_781_632


def test_hf_config_missing_hidden_size_raises():
    config = {k: v for k, v in LLAMA3_8B_CONFIG.items() if k != "hidden_size"}
    with pytest.raises(HfConfigError):
        model_from_hf_config(config)


def test_hf_config_missing_vocab_raises():
    config = {k: v for k, v in GPT2_CONFIG.items() if k != "vocab_size"}
    with pytest.raises(HfConfigError):
        model_from_hf_config(config)


def test_hf_config_error_is_value_error():
    assert issubclass(HfConfigError, ValueError)


def test_qwen2_5_7b_counts_its_qkv_biases():
    m = model_preset("qwen2.5-7b")
    assert m.qkv_bias and not m.linear_bias
    # Qwen/Qwen2.5-7B: 7,615,616,512 parameters (the checkpoint's tensors); Q, K and V carry biases
    assert m.total_params == 7_615_616_512
    without = dataclasses.replace(m, qkv_bias=False)
    assert m.total_params - without.total_params == 28 * (3584 + 2 * 4 * 128)


@pytest.mark.parametrize(
    "name,theta,epsilon,scaling",
    [
        ("llama2-7b", 10_000.0, 1e-5, None),  # Llama-2-7b-hf: rope_theta default, rms_norm_eps 1e-05
        ("llama3-8b", 500_000.0, 1e-5, None),  # Meta-Llama-3-8B: rope_scaling null
        ("llama3.1-8b", 500_000.0, 1e-5, 8.0),  # Llama-3.1-8B: rope_type llama3, factor 8
        ("llama3-405b", 500_000.0, 1e-5, 8.0),  # published only as Llama 3.1
        ("qwen2.5-7b", 1_000_000.0, 1e-6, None),
        ("qwen2.5-72b", 1_000_000.0, 1e-5, None),
    ],
)
def test_presets_carry_their_published_rope_and_norm(name, theta, epsilon, scaling):
    m = model_preset(name)
    assert (m.normalization, m.position_embedding) == ("rmsnorm", "rope")
    assert (m.rope_theta, m.norm_epsilon) == (theta, epsilon)
    assert (m.rope_scaling.factor if m.rope_scaling else None) == scaling
    if scaling:
        assert (m.rope_scaling.low_freq_factor, m.rope_scaling.high_freq_factor) == (1.0, 4.0)
        assert m.rope_scaling.original_max_position_embeddings == 8192


def test_gpt3_is_layernorm_learned_positions_and_biases():
    m = model_preset("gpt3-175b")
    assert (m.normalization, m.position_embedding, m.max_position_embeddings, m.linear_bias) == (
        "layernorm", "learned", 2048, True)


def test_hf_llama_reads_rope_and_norm():
    m = model_from_hf_config(LLAMA3_8B_CONFIG)
    assert (m.rope_theta, m.rope_scaling, m.norm_epsilon, m.normalization) == (500_000.0, None, 1e-5, "rmsnorm")
    assert not m.qkv_bias and not m.linear_bias


# Verbatim rope fields of meta-llama/Llama-3.1-8B/config.json
LLAMA31_ROPE = {"rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                "rope_theta": 500000.0, "max_position_embeddings": 131072}


def test_hf_llama31_rope_scaling():
    m = model_from_hf_config({**LLAMA3_8B_CONFIG, **LLAMA31_ROPE})
    assert m.rope_scaling == RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=8192)
    assert m == dataclasses.replace(model_preset("llama3.1-8b"), name="llama")


def test_hf_transformers5_rope_parameters():
    config = {k: v for k, v in LLAMA3_8B_CONFIG.items() if k not in ("rope_theta", "rope_scaling")}
    config["rope_parameters"] = {**LLAMA31_ROPE["rope_scaling"], "rope_theta": 500000.0}
    m = model_from_hf_config(config)
    assert m.rope_theta == 500000.0 and m.rope_scaling.factor == 8.0


@pytest.mark.parametrize("kind", ["linear", "dynamic", "longrope"])
def test_hf_rope_scaling_other_than_llama3_or_yarn_is_refused_by_name(kind):
    config = {**LLAMA3_8B_CONFIG, "rope_scaling": {"rope_type": kind, "factor": 4.0}}
    with pytest.raises(HfConfigError, match=rf"rope_scaling type '{kind}' is not supported"):
        model_from_hf_config(config)


# Verbatim architecture fields of Qwen/Qwen2.5-7B/config.json (its modeling code hard-codes Q, K, V biases)
QWEN25_7B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 3584, "intermediate_size": 18944,
    "max_position_embeddings": 131072, "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "vocab_size": 152064,
}


def test_hf_qwen2_has_qkv_bias():
    m = model_from_hf_config(QWEN25_7B_CONFIG)
    assert m.qkv_bias and not m.linear_bias
    assert dataclasses.replace(m, name="qwen2.5-7b") == model_preset("qwen2.5-7b")


def test_hf_llama_with_attention_and_mlp_bias_has_linear_bias():
    m = model_from_hf_config({**LLAMA3_8B_CONFIG, "attention_bias": True, "mlp_bias": True})
    assert m.linear_bias and not m.qkv_bias


def test_hf_attention_bias_without_mlp_bias_is_refused():
    with pytest.raises(HfConfigError, match="attention_bias true with mlp_bias false is not supported"):
        model_from_hf_config({**LLAMA3_8B_CONFIG, "attention_bias": True})


def test_hf_bias_flags_must_be_booleans():
    with pytest.raises(HfConfigError, match="attention_bias must be true or false"):
        model_from_hf_config({**LLAMA3_8B_CONFIG, "attention_bias": "no"})


# Verbatim MoE fields of mistralai/Mixtral-8x7B-v0.1, deepseek-ai/DeepSeek-V3, Qwen/Qwen1.5-MoE-A2.7B and
# databricks/dbrx-base, in a config whose model_type (llama) resiplan does not read experts for
@pytest.mark.parametrize(
    "fields,named",
    [
        ({"num_local_experts": 8, "num_experts_per_tok": 2}, "num_local_experts is 8"),
        ({"n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8}, "n_routed_experts is 256"),
        ({"num_experts": 60, "moe_intermediate_size": 1408, "num_experts_per_tok": 4}, "num_experts is 60"),
        ({"ffn_config": {"moe_num_experts": 16, "moe_top_k": 4}}, "hf_config ffn_config moe_num_experts is 16"),
        ({"shared_expert_intermediate_size": 5632}, "shared_expert_intermediate_size is 5632"),
    ],
)
def test_hf_experts_of_a_family_not_read_are_refused_naming_the_field(fields, named):
    with pytest.raises(HfConfigError, match=named) as refused:
        model_from_hf_config({**LLAMA3_8B_CONFIG, **fields})
    assert "mixture-of-experts field resiplan does not read for model_type 'llama'" in str(refused.value)


# Verbatim architecture fields of mistralai/Mixtral-8x7B-v0.1/config.json
MIXTRAL_8X7B_CONFIG = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0", "use_cache": True,
    "vocab_size": 32000,
}

# Verbatim architecture fields of Qwen/Qwen2-57B-A14B/config.json
QWEN2_57B_A14B_CONFIG = {
    "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584,
    "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 131072,
    "max_window_layers": 28, "model_type": "qwen2_moe", "moe_intermediate_size": 2560, "norm_topk_prob": False,
    "num_attention_heads": 28, "num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 20480, "sliding_window": 131072,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}

# Verbatim architecture fields of Qwen/Qwen3-30B-A3B/config.json: its 32 heads of head_dim 128 make attention
# 4,096 wide over a hidden size of 2,048 (ModelSpec.head_dim).
QWEN3_30B_A3B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}


@pytest.mark.parametrize(
    "name,total,active,active_rel",
    [
        # Mistral AI, "Mixtral of experts" (Dec 2023): 46.7B total parameters, 12.9B used per token
        ("mixtral-8x7b", 46.7e9, 12.9e9, 0.01),
        # Qwen2 blog: 57.41B parameters; 14B activated, published only as a whole number of billions ("A14B"),
        # so within half a billion (the count is 14.25B)
        ("qwen2-57b-a14b", 57.41e9, 14e9, 0.5 / 14),
    ],
)
def test_moe_presets_total_and_active_params_match_published(name, total, active, active_rel):
    m = model_preset(name)
    assert m.is_moe
    assert m.total_params == pytest.approx(total, rel=0.01)
    assert m.active_params == pytest.approx(active, rel=active_rel)


def test_mixtral_8x7b_params_by_hand():
    h, f, L, V, E, k, kv_width = 4096, 14336, 32, 32000, 8, 2, 8 * 128
    attention = h * (h + 2 * kv_width) + h * h
    expert = 3 * h * f  # w1, w3 (gate, up) and w2 (down)
    per_layer = attention + h * E + E * expert + 2 * h  # router, 8 experts, two RMSNorms
    m = model_preset("mixtral-8x7b")
    assert m.params_per_layer == per_layer
    assert m.total_params == L * per_layer + 2 * V * h + h == 46_702_792_704
    assert m.active_params == m.total_params - L * (E - k) * expert == 12_879_925_248


def test_qwen2_57b_a14b_non_embedding_params_match_published():
    m = model_preset("qwen2-57b-a14b")
    # Qwen2 blog: 56.32B non-embedding parameters (the two 151,936 x 3,584 tables left out). The shared
    # expert (20,480 wide, 8 experts' worth) is counted; its 1-wide gate (28 x 3,584 weights) is not.
    assert m.total_params - m.embedding_params - m.head_params == pytest.approx(56.32e9, rel=0.001)
    without_shared = dataclasses.replace(m, shared_expert_ffn_hidden_size=0)
    assert m.total_params - without_shared.total_params == 28 * 3 * 3584 * 20480
    assert m.active_params - without_shared.active_params == 28 * 3 * 3584 * 20480


@pytest.mark.parametrize("name,config", [("mixtral-8x7b", MIXTRAL_8X7B_CONFIG),
                                         ("qwen2-57b-a14b", QWEN2_57B_A14B_CONFIG)])
def test_hf_moe_config_reads_as_its_preset(name, config):
    m = model_from_hf_config(config)
    assert dataclasses.replace(m, name=name) == model_preset(name)


def test_hf_mixtral_experts():
    m = model_from_hf_config(MIXTRAL_8X7B_CONFIG)
    assert (m.num_experts, m.experts_per_token, m.ffn_hidden_size, m.shared_expert_ffn_hidden_size) == (
        8, 2, 14336, 0)
    assert m.swiglu and not m.qkv_bias and not m.linear_bias


def test_hf_qwen2_moe_experts_shared_expert_and_qkv_bias():
    m = model_from_hf_config(QWEN2_57B_A14B_CONFIG)
    # moe_intermediate_size is the routed expert's width; intermediate_size (18,944) is for dense layers it has none of
    assert (m.num_experts, m.experts_per_token, m.ffn_hidden_size, m.shared_expert_ffn_hidden_size) == (
        64, 8, 2560, 20480)
    assert m.qkv_bias and not m.linear_bias
    # newer transformers releases write qkv_bias into Qwen2-MoE configs
    assert not model_from_hf_config({**QWEN2_57B_A14B_CONFIG, "qkv_bias": False}).qkv_bias


def test_hf_qwen3_moe_with_heads_as_wide_as_the_hidden_size_is_read():
    # Qwen3-30B-A3B's experts and routing, with 16 heads of 128 (head_dim == hidden_size / heads)
    config = {**QWEN3_30B_A3B_CONFIG, "num_attention_heads": 16}
    m = model_from_hf_config(config)
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_heads, m.vocab_size) == (
        48, 2048, 16, 4, 151936)
    assert (m.num_experts, m.experts_per_token, m.ffn_hidden_size, m.shared_expert_ffn_hidden_size) == (
        128, 8, 768, 0)
    assert m.swiglu and not m.qkv_bias and not m.linear_bias and not m.tied_embeddings
    assert (m.rope_theta, m.norm_epsilon) == (1_000_000.0, 1e-6)
    # no head_dim: hidden_size / heads, as Qwen3's attention defaults it
    config.pop("head_dim")
    assert model_from_hf_config(config) == m


@pytest.mark.parametrize("config,preset", [
    (QWEN3_30B_A3B_CONFIG, "qwen3-30b-a3b"),
    # Qwen/Qwen3-235B-A22B: 64 heads of 128 over a hidden size of 4,096
    ({**QWEN3_30B_A3B_CONFIG, "hidden_size": 4096, "num_attention_heads": 64, "num_hidden_layers": 94,
      "moe_intermediate_size": 1536}, "qwen3-235b-a22b")])
def test_hf_qwen3_moe_heads_wider_than_hidden_over_heads_read_as_the_preset(config, preset):
    """Qwen3's 128-wide heads make Q and the attention output wider than the hidden size; its per-head query
    and key norms come with the family."""
    spec = model_from_hf_config(config)
    assert (spec.head_dim, spec.qk_norm, spec.q_width) == (128, True, spec.num_attention_heads * 128)
    assert dataclasses.replace(spec, name=preset) == model_preset(preset)


@pytest.mark.parametrize("name,total,active", [("qwen3-30b-a3b", 30.5e9, 3.3e9), ("qwen3-235b-a22b", 235e9, 22e9)])
def test_qwen3_moe_presets_match_the_published_counts(name, total, active):
    """Qwen3 technical report (Yang et al. 2025), Table 2 and the model cards: 30.5B total / 3.3B activated,
    235B / 22B. Attention is heads x 128 wide, not the hidden size."""
    spec = model_preset(name)
    assert spec.total_params == pytest.approx(total, rel=0.005)
    assert spec.active_params == pytest.approx(active, rel=0.02)
    q, kv, h = spec.num_attention_heads * 128, spec.num_kv_heads * 128, spec.hidden_size
    assert spec.params_per_layer - spec.routed_expert_params_per_layer == (
        h * (q + 2 * kv) + q * h + 2 * 128 + h * spec.num_experts + 2 * h)


def test_hf_dense_head_dim_other_than_hidden_over_heads_is_read():
    # Qwen/Qwen3-32B: 64 heads of 128 over 5,120 (dense; it used to be read as 64 heads of 80)
    spec = model_from_hf_config({**LLAMA3_8B_CONFIG, "model_type": "qwen3", "hidden_size": 5120,
                                 "num_attention_heads": 64, "head_dim": 128})
    assert (spec.head_dim, spec.q_width, spec.kv_width, spec.qk_norm) == (128, 8192, 8 * 128, True)
    # head_dim equal to hidden_size / heads (Llama 3.2's configs write it) is read as before
    assert model_from_hf_config({**LLAMA3_8B_CONFIG, "head_dim": 128}) == model_from_hf_config(LLAMA3_8B_CONFIG)


@pytest.mark.parametrize(
    "config,named",
    [
        # dense MLP layers among the expert ones
        ({**QWEN2_57B_A14B_CONFIG, "decoder_sparse_step": 2}, "decoder_sparse_step is 2: dense MLP layers"),
        ({**QWEN2_57B_A14B_CONFIG, "mlp_only_layers": [0, 27]}, "mlp_only_layers is [0, 27]: dense MLP layers"),
        ({**MIXTRAL_8X7B_CONFIG, "first_k_dense_replace": 3}, "first_k_dense_replace is 3: dense MLP layers"),
        ({**MIXTRAL_8X7B_CONFIG, "moe_layer_freq": 2}, "moe_layer_freq is 2: dense MLP layers"),
        ({**QWEN2_57B_A14B_CONFIG, "decoder_sparse_step": True}, "decoder_sparse_step is True: dense MLP layers"),
        # expert fields the family's reader does not take
        ({**MIXTRAL_8X7B_CONFIG, "moe_intermediate_size": 1408},
         "moe_intermediate_size is 1408: a mixture-of-experts field resiplan does not read for model_type 'mixtral'"),
        ({**QWEN2_57B_A14B_CONFIG, "n_shared_experts": 2},
         "n_shared_experts is 2: a mixture-of-experts field resiplan does not read for model_type 'qwen2_moe'"),
        ({**MIXTRAL_8X7B_CONFIG, "ffn_config": {"moe_num_experts": 16}}, "hf_config ffn_config moe_num_experts is 16"),
        ({**QWEN2_57B_A14B_CONFIG, "moe_top_k": 4}, "moe_top_k is 4: a mixture-of-experts field"),
        # expert counts
        ({**MIXTRAL_8X7B_CONFIG, "num_experts_per_tok": 9}, "num_experts_per_tok 9 exceeds num_local_experts 8"),
        ({**MIXTRAL_8X7B_CONFIG, "num_local_experts": 4097}, "num_local_experts must be a whole number from 1 to 4,096"),
        ({**MIXTRAL_8X7B_CONFIG, "num_local_experts": 0}, "num_local_experts must be a whole number from 1 to 4,096"),
        ({**QWEN2_57B_A14B_CONFIG, "num_experts": 2.5}, "num_experts must be a whole number from 1 to 4,096, got 2.5"),
        ({**MIXTRAL_8X7B_CONFIG, "num_experts_per_tok": 0}, "num_experts_per_tok must be a whole number from 1"),
        ({**MIXTRAL_8X7B_CONFIG, "num_experts": 4}, "num_experts 4 disagrees with num_local_experts 8"),
        ({k: v for k, v in MIXTRAL_8X7B_CONFIG.items() if k != "num_local_experts"},
         "has none of num_local_experts, num_experts"),
        ({k: v for k, v in QWEN2_57B_A14B_CONFIG.items() if k != "shared_expert_intermediate_size"},
         "has none of shared_expert_intermediate_size"),
        ({**QWEN2_57B_A14B_CONFIG, "moe_intermediate_size": 2**21},
         "moe_intermediate_size must be a whole number from 1 to 1,048,576"),
        # experts of other kinds
        ({**MIXTRAL_8X7B_CONFIG, "hidden_act": "gelu"}, "hidden_act 'gelu' with experts is not supported"),
    ],
)
def test_hf_moe_configs_resiplan_does_not_model_are_refused_naming_the_field(config, named):
    with pytest.raises(HfConfigError, match=re.escape(named)) as refused:
        model_from_hf_config(config)
    assert str(refused.value).startswith("hf_config")


# Architecture fields of deepseek-ai/DeepSeek-V3/config.json (its MoE fields and multi-head latent attention)
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "v_head_dim": 128, "vocab_size": 129280,
}


# deepseek-ai/DeepSeek-V2-Lite/config.json's architecture fields: no query latent (q_lora_rank null), one dense layer
DEEPSEEK_V2_LITE_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"], "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                                            "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "tie_word_embeddings": False,
    "topk_group": 1, "topk_method": "greedy", "v_head_dim": 128, "vocab_size": 102400,
}


def _deepseek_params_by_hand(h: int, heads: int, q_rank: int, layers: int, dense: int, dense_width: int,
                             experts: int, width: int, shared: int, vocab: int) -> int:
    """Module by module, as DeepSeek's modeling code builds them (kv latent 512, rotary 64, nope 128, value 128)."""
    q = h * q_rank + q_rank + q_rank * heads * 192 if q_rank else h * heads * 192
    attention = q + h * (512 + 64) + 512 + 512 * heads * (128 + 128) + heads * 128 * h
    expert_mlp = h * experts + experts * 3 * h * width + shared * 3 * h * width
    return (dense * (attention + 2 * h + 3 * h * dense_width) + (layers - dense) * (attention + 2 * h + expert_mlp)
            + 2 * vocab * h + h)


def test_hf_deepseek_v3_is_read_with_latent_attention_dense_layers_and_shared_experts():
    spec = model_from_hf_config(DEEPSEEK_V3_CONFIG)
    assert (spec.kv_lora_rank, spec.q_lora_rank, spec.head_dim, spec.qk_rope_head_dim, spec.v_head_dim) == (
        512, 1536, 128, 64, 128)
    assert (spec.dense_layers, spec.dense_ffn_hidden_size, spec.ffn_hidden_size, spec.shared_expert_ffn_hidden_size) == (
        3, 18432, 2048, 2048)
    total = _deepseek_params_by_hand(7168, 128, 1536, 61, 3, 18432, 256, 2048, 1, 129280)
    assert round(total / 1e9) == 671  # DeepSeek-V3 technical report: 671B parameters (without its MTP module)
    expert_layer = (_deepseek_params_by_hand(7168, 128, 1536, 2, 1, 18432, 256, 2048, 1, 129280)
                    - _deepseek_params_by_hand(7168, 128, 1536, 1, 1, 18432, 256, 2048, 1, 129280))
    # num_nextn_predict_layers 1: one more expert layer, the 2h x h projection, two input norms and a final one
    assert spec.mtp_layers == 1 and spec.total_params == total + expert_layer + 2 * 7168 * 7168 + 3 * 7168
    main_active = spec.active_params - (spec.mtp_params - 248 * 3 * 7168 * 2048)
    assert main_active == total - 58 * (256 - 8) * 3 * 7168 * 2048  # "37B activated for each token"
    assert 37e9 < main_active < 38e9
    assert spec == dataclasses.replace(model_preset("deepseek-v3"), name="deepseek_v3", rope_scaling=None)


def test_hf_deepseek_v2_lite_has_no_query_latent():
    spec = model_from_hf_config(DEEPSEEK_V2_LITE_CONFIG)
    assert (spec.q_lora_rank, spec.kv_lora_rank, spec.dense_layers, spec.shared_expert_ffn_hidden_size) == (
        0, 512, 1, 2 * 1408)
    total = _deepseek_params_by_hand(2048, 16, 0, 27, 1, 10944, 64, 1408, 2, 102400)
    assert spec.total_params == total and round(total / 1e8) == 157  # "15.7B total parameters"
    assert (spec.rope_scaling.mscale, spec.rope_scaling.mscale_all_dim, spec.rope_scaling.factor) == (0.707, 0.707, 40)
    assert spec == dataclasses.replace(model_preset("deepseek-v2-lite"), name="deepseek_v2")


def test_hf_latent_attention_outside_deepseek_is_refused_naming_the_field():
    with pytest.raises(HfConfigError, match="hf_config q_lora_rank is 1536: multi-head latent attention"):
        model_from_hf_config({**LLAMA3_8B_CONFIG, "q_lora_rank": 1536})
    with pytest.raises(HfConfigError, match="hf_config has none of kv_lora_rank"):
        model_from_hf_config({k: v for k, v in DEEPSEEK_V3_CONFIG.items() if k != "kv_lora_rank"})
    with pytest.raises(HfConfigError, match="hf_config has none of qk_rope_head_dim"):
        model_from_hf_config({k: v for k, v in DEEPSEEK_V3_CONFIG.items() if k != "qk_rope_head_dim"})
    # dense layers other than the first ones are still refused by name
    with pytest.raises(HfConfigError, match="moe_layer_freq is 2: dense MLP layers"):
        model_from_hf_config({**DEEPSEEK_V3_CONFIG, "moe_layer_freq": 2})
    # multi-token prediction is read as DeepSeek builds it, and refused elsewhere rather than dropped
    with pytest.raises(HfConfigError, match="num_nextn_predict_layers is 1: multi-token prediction is modelled as"):
        model_from_hf_config({**LLAMA3_8B_CONFIG, "num_nextn_predict_layers": 1})


def test_hf_moe_refusals_do_not_echo_hostile_values_unbounded():
    for field in ("mlp_only_layers", "moe_layer_freq", "kv_lora_rank"):
        with pytest.raises(HfConfigError) as refused:
            model_from_hf_config({**MIXTRAL_8X7B_CONFIG, field: "x" * 10_000})
        assert len(str(refused.value)) < 400 and field in str(refused.value)


def test_hf_dense_config_with_empty_expert_fields_is_planned():
    m = model_from_hf_config({**LLAMA3_8B_CONFIG, "num_experts": None, "num_local_experts": 1, "moe_layer_freq": 0})
    assert m.total_params == 8_030_261_248


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"num_hidden_layers": 1025}, "num_hidden_layers must be a whole number from 1 to 1,024, got 1025"),
        ({"num_hidden_layers": 100_000}, "num_hidden_layers must be a whole number from 1 to 1,024"),
        ({"_name_or_path": "x" * 129}, "_name_or_path is 129 characters; at most 128"),
        ({"vocab_size": 2**23}, "vocab_size must be a whole number from 1 to 4,194,304"),
        ({"rope_theta": float("nan")}, "rope_theta must be a number"),
        ({"rms_norm_eps": -1}, "rms_norm_eps must be a number above 0"),
    ],
)
def test_hf_config_limits_are_the_architecture_limits(fields, message):
    with pytest.raises(HfConfigError, match=re.escape(message)):
        model_from_hf_config({**LLAMA3_8B_CONFIG, **fields})


_HOSTILE_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8), st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
_KEYS = sorted({*LLAMA3_8B_CONFIG, *GPT2_CONFIG, *PYTHIA_1B_CONFIG, "rope_parameters", "partial_rotary_factor",
                "attention_bias", "mlp_bias", "bias", "num_local_experts", "moe_intermediate_size", "ffn_config"})


@settings(max_examples=300, derandomize=True, deadline=None)
@given(base=st.sampled_from([LLAMA3_8B_CONFIG, GPT2_CONFIG, PYTHIA_1B_CONFIG, QWEN25_7B_CONFIG]),
       changes=st.dictionaries(st.sampled_from(_KEYS), _HOSTILE_VALUES, max_size=4))
def test_hf_configs_give_a_plannable_spec_or_a_named_error(base, changes):
    """Whatever a config holds, the parser answers a spec within the architecture limits or an HfConfigError,
    never another exception and never a model outside the limits (which used to solve, then answer 500)."""
    config = {**base, **changes}
    try:
        spec = model_from_hf_config(config)
    except HfConfigError as error:
        assert str(error).startswith("hf_config")
        return
    for field, limit in ARCHITECTURE_LIMITS.items():
        value = getattr(spec, field)
        least = 0 if field == "num_experts" else 1  # 0 experts: a dense MLP
        assert value is None or least <= value <= limit, (field, value)
    assert len(spec.name) <= MAX_MODEL_NAME_CHARS


_MOE_KEYS = sorted({*MIXTRAL_8X7B_CONFIG, *QWEN2_57B_A14B_CONFIG, "num_local_experts", "head_dim", "kv_lora_rank",
                    "first_k_dense_replace", "moe_layer_freq", "mlp_only_layers", "n_shared_experts", "ffn_config",
                    "bias", "qkv_bias"})


@settings(max_examples=300, derandomize=True, deadline=None)
@given(base=st.sampled_from([MIXTRAL_8X7B_CONFIG, QWEN2_57B_A14B_CONFIG, QWEN3_30B_A3B_CONFIG]),
       changes=st.dictionaries(st.sampled_from(_MOE_KEYS), _HOSTILE_VALUES, max_size=3))
def test_hf_moe_configs_give_a_consistent_spec_or_a_named_error(base, changes):
    """Mixture-of-experts configs with hostile fields: a spec the wire's expert rules accept (1 <= top-k <=
    experts, biases only where the config asks), within the limits, or an HfConfigError; never another
    exception."""
    config = {**base, **changes}
    try:
        spec = model_from_hf_config(config)
    except HfConfigError as error:
        assert str(error).startswith("hf_config") and len(str(error)) < 600
        return
    for field, limit in ARCHITECTURE_LIMITS.items():
        value = getattr(spec, field)
        assert value is None or (0 if field == "num_experts" else 1) <= value <= limit, (field, value)
    assert spec.is_moe and 1 <= spec.experts_per_token <= spec.num_experts
    assert spec.swiglu
    # biases only where the config asks for them (then on the router and experts too, as GPT-OSS has them)
    assert not spec.linear_bias or any(config.get(key) is True for key in ("bias", "use_bias", "attention_bias",
                                                                           "mlp_bias"))
    if config.get("head_dim") is not None:
        assert config["head_dim"] * spec.num_attention_heads == spec.q_width


# openai/gpt-oss-120b config.json, verbatim architecture fields (quantization_config left out: it describes the
# released MXFP4 inference weights, not the trained model)
GPT_OSS_120B_CONFIG = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "experts_per_token": 4,
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 18,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 36, "num_key_value_heads": 8, "num_local_experts": 128, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "vocab_size": 201088,
}


def test_gpt_oss_config_is_the_preset():
    spec = model_from_hf_config({**GPT_OSS_120B_CONFIG, "_name_or_path": "gpt-oss-120b"})
    assert spec == model_preset("gpt-oss-120b")
    assert (spec.attention_sinks, spec.linear_bias, spec.sliding_window, spec.full_attention_every) == (True, True, 128, 2)
    assert (spec.rope_scaling.rope_type, spec.rope_scaling.factor, spec.rope_scaling.original_max_position_embeddings) \
        == ("yarn", 32.0, 4096)


@pytest.mark.parametrize("name,total,active", [("gpt-oss-120b", 116.83e9, 5.13e9), ("gpt-oss-20b", 20.91e9, 3.61e9)])
def test_gpt_oss_presets_match_the_published_counts(name, total, active):
    """OpenAI's gpt-oss model card, Table 1: 116.83B total and 5.13B active parameters, 20.91B and 3.61B. Its
    active count leaves out the input embedding (the unembedding is counted): so does this one."""
    spec = model_preset(name)
    assert spec.total_params == pytest.approx(total, rel=5e-4)  # published to 10M
    assert spec.active_params - spec.embedding_params == pytest.approx(active, rel=1e-3)  # published to 10M


def test_gpt_oss_layer_weights_by_hand():
    """Q, K, V and output with biases, a sink per head, a biased router and 128 biased SwiGLU experts, two norms."""
    h, f, q, kv, experts = 2880, 2880, 64 * 64, 8 * 64, 128
    attention = h * (q + 2 * kv) + (q + 2 * kv) + q * h + h + 64
    one_expert = 3 * h * f + 2 * f + h
    router = h * experts + experts
    spec = model_preset("gpt-oss-120b")
    assert spec.routed_expert_params_per_layer == experts * one_expert
    assert spec.params_per_layer == attention + router + experts * one_expert + 2 * h


@pytest.mark.parametrize("kinds,named", [
    (["sliding_attention", "full_attention", "full_attention", "sliding_attention"], "not this pattern"),
    (["sliding_attention", "local"], "must list"),
])
def test_hf_layer_types_other_than_every_kth_full_are_refused(kinds, named):
    config = {**GPT_OSS_120B_CONFIG, "num_hidden_layers": len(kinds), "layer_types": kinds}
    with pytest.raises(HfConfigError, match=named):
        model_from_hf_config(config)


def test_hf_layer_types_must_list_every_layer():
    with pytest.raises(HfConfigError, match="layer_types lists 4 layers, num_hidden_layers says 36"):
        model_from_hf_config({**GPT_OSS_120B_CONFIG, "layer_types": ["sliding_attention", "full_attention"] * 2})


def test_hf_layer_types_all_full_or_all_windowed():
    full = model_from_hf_config({**LLAMA3_8B_CONFIG, "layer_types": ["full_attention"] * 32, "sliding_window": 4096})
    assert full.sliding_window is None and full == model_from_hf_config(LLAMA3_8B_CONFIG)
    windowed = model_from_hf_config({**LLAMA3_8B_CONFIG, "layer_types": ["sliding_attention"] * 32,
                                     "sliding_window": 4096})
    assert (windowed.sliding_window, windowed.full_attention_every, windowed.windowed_layers) == (4096, 0, 32)
    # without layer_types a config's sliding_window is not read (Qwen2's carries one it does not use)
    assert model_from_hf_config({**LLAMA3_8B_CONFIG, "sliding_window": 4096}).sliding_window is None


def test_biases_on_every_linear_layer_with_experts_are_the_routers_and_experts_too():
    spec = model_from_hf_config({**MIXTRAL_8X7B_CONFIG, "bias": True})
    plain = model_from_hf_config(MIXTRAL_8X7B_CONFIG)
    h, f, experts = 4096, 14336, 8
    assert spec.linear_bias
    # Q, K, V (h + 2 x 1,024 wide) and output biases, the router's, every expert's gate, up and down
    assert spec.params_per_layer - plain.params_per_layer == (h + 2 * 1024) + h + experts + experts * (2 * f + h)


def test_gpt_oss_needs_its_biases():
    with pytest.raises(HfConfigError, match="attention_bias false with model_type gpt_oss"):
        model_from_hf_config({**GPT_OSS_120B_CONFIG, "attention_bias": False})


def test_yarn_scaling_is_read_and_a_truncated_one_refused():
    scaling = model_from_hf_config(GPT_OSS_120B_CONFIG).rope_scaling
    assert (scaling.beta_fast, scaling.beta_slow) == (32.0, 1.0)
    truncated = {**GPT_OSS_120B_CONFIG, "rope_scaling": {**GPT_OSS_120B_CONFIG["rope_scaling"], "truncate": True}}
    with pytest.raises(HfConfigError, match="truncate true is not supported"):
        model_from_hf_config(truncated)
