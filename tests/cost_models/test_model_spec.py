"""Presets against published configs, parameter counts by hand, HF config parsing."""

from __future__ import annotations

import pytest

from cost_models.model_spec import (
    HfConfigError,
    ModelSpec,
    model_from_hf_config,
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
    h, V, L = 12288, 50257, 96
    expected = L * (12 * h**2 + 2 * h) + V * h + h  # GPT-3: 4h^2 attention + 8h^2 MLP
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
    # 12 * (12 h^2 + 2 h) + V h + h, biases and position embeddings ignored
    assert m.total_params == 12 * (12 * 768**2 + 2 * 768) + 50257 * 768 + 768


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
    # 16 (12 h^2 + 2 h) + 2 V h + h = 1.01B (Pythia "1B"; 1,011,781,632 with biases)
    assert m.total_params == 16 * (12 * 2048**2 + 2 * 2048) + 2 * 50304 * 2048 + 2048
    assert m.total_params == pytest.approx(1.0118e9, rel=0.01)


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
