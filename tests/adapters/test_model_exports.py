"""The model each trainer builds from the export is the plan's model: same parameter count, same parts.

- Megatron-LM: the exported pretrain_gpt.py flags, parsed with Megatron-LM's definitions (copied in
  test_megatron.py; megatron.training is not in the megatron-core wheel) and its validate_args rules,
  become the TransformerConfig and GPTModel that Megatron-LM 0.16.1's gpt_builder makes (local layer
  spec, as without Transformer Engine), built by megatron-core 0.16 on the meta device;
- Megatron-DeepSpeed: the flags in the DeepSpeed export's `resiplan.megatron_deepspeed.args`, parsed
  with Megatron-DeepSpeed's definitions (copied from its megatron/arguments.py: it is not on PyPI), as
  the same megatron-core model (its legacy GPT has the same parameters for these options);
- torchtitan: `adapters.torchtitan_model.llama3_model_config`, built by torchtitan 0.3 on the meta device.

Each count equals `ModelSpec.total_params`, the number the planner's memory model uses. Small custom
architectures (hidden 256) cover every option; presets are built at full size on the meta device.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore

with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": expected on CPU
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from adapters import deepspeed as ds_export
from adapters import megatron
from adapters.registry import ExportError
from adapters.torchtitan_model import llama3_model_config, model_config
from api.tasks.planning import plan_for
from cost_models.model_spec import model_preset
from tests.adapters.test_megatron import (
    parse,
    transformer_config,
    validate_like_megatron_lm,
)
from tests.api.support import small_request
from wire.convert import resolve_model
from wire.schemas import ModelArchitecture, Plan, PlanRequest

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:megatron")

TINY = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "vocab_size": 1000}
ARCHITECTURES = {
    # Llama 3.1-like: GQA, SwiGLU, RMSNorm 1e-6, RoPE 500000 with Llama 3.1 scaling, untied, no biases
    "llama31-like": {**TINY, "ffn_hidden_size": 688, "num_kv_heads": 2, "norm_epsilon": 1e-6, "rope_theta": 500000,
                     "rope_scaling": {"factor": 8.0}},
    # Qwen2-like: Q, K, V biases, tied embeddings, RoPE 1e6
    "qwen2-like": {**TINY, "ffn_hidden_size": 704, "num_kv_heads": 4, "qkv_bias": True, "tied_embeddings": True,
                   "rope_theta": 1_000_000},
    # GPT-3-like: LayerNorm, learned positions, biases everywhere, GELU, tied
    "gpt3-like": {**TINY, "ffn_hidden_size": 1024, "swiglu": False, "tied_embeddings": True,
                  "normalization": "layernorm", "position_embedding": "learned", "max_position_embeddings": 2048,
                  "linear_bias": True},
    # GPT-NeoX-like: LayerNorm, RoPE on a quarter of each head, biases everywhere, untied
    "neox-like": {**TINY, "ffn_hidden_size": 1024, "swiglu": False, "normalization": "layernorm",
                  "rotary_percent": 0.25, "linear_bias": True},
    # GPT-OSS's attention without YaRN: a learned sink logit per head, 128-token windows, every 2nd layer full
    "sinks-windows-like": {**TINY, "ffn_hidden_size": 688, "num_kv_heads": 2, "rope_theta": 150000,
                           "attention_sinks": True, "sliding_window": 128, "full_attention_every": 2},
}
PRESETS = ["llama3-8b", "llama3.1-70b", "qwen2.5-7b", "gpt3-175b"]
# DeepSeek-V3-like: latent attention (a query latent, a key/value latent with shared rotary dimensions), the first
# layer dense, shared experts, YaRN with DeepSeek's temperature, one multi-token-prediction depth
LATENT = {**TINY, "ffn_hidden_size": 96, "num_attention_heads": 4, "num_kv_heads": 4, "head_dim": 32, "q_lora_rank": 64,
          "kv_lora_rank": 48, "qk_rope_head_dim": 16, "v_head_dim": 24, "num_experts": 8, "experts_per_token": 2,
          "shared_expert_ffn_hidden_size": 96, "dense_layers": 1, "dense_ffn_hidden_size": 320, "norm_epsilon": 1e-6,
          "mtp_layers": 1,
          "rope_scaling": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                           "mscale": 1.0, "mscale_all_dim": 1.0}}


@functools.cache
def tiny_plan(name: str) -> Plan:
    request = small_request(model={**ARCHITECTURES[name], "name": name},
                            options={"time_limit_s": 2, "allow_non_uniform": False})
    return plan_for(PlanRequest.model_validate(request))


@functools.cache
def preset_plan(name: str) -> Plan:
    """A planned layout carrying the preset's architecture (only the model flags are read from it)."""
    plan = tiny_plan("llama31-like")
    architecture = ModelArchitecture.model_validate(dataclasses.asdict(model_preset(name)))
    return plan.model_copy(update={"architecture": architecture})


def planned_params(plan: Plan) -> int:
    return resolve_model(plan.architecture).total_params


@pytest.fixture(scope="module")
def one_rank():
    """megatron-core needs its parallel state, even for a model on one rank."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def megatron_core_model(config: TransformerConfig, vocab_size: int, max_positions: int, untie: bool,
                        position_embedding_type: str, rotary_percent: float, rotary_base: int,
                        rope_scaling: bool) -> GPTModel:
    """The GPTModel of Megatron-LM's gpt_builder (local spec), on the meta device (megatron-core puts a learnable
    softmax offset on `torch.cuda.current_device()` explicitly: the meta device there too)."""
    if config.num_moe_experts:  # Megatron-LM's gpt_builder: the decoder block spec, dense and expert layers
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=config.normalization)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm,
                                        multi_latent_attention=config.multi_latent_attention,
                                        normalization=config.normalization)
    if config.multi_latent_attention:
        spec = _weightless_core_attention(spec)
    # gpt_builder's multi-token prediction: the block spec's last layer, one per depth
    last_layer = spec.layer_specs[-1] if hasattr(spec, "layer_specs") else spec
    mtp = (get_gpt_mtp_block_spec(config, last_layer, use_transformer_engine=False)
           if config.mtp_num_layers else None)
    # Without Transformer Engine installed megatron-core 0.16 still imports its extension module, so MLASelfAttention
    # believes TE present and tests isinstance against its missing TELinear (an FP8-only branch): say it is absent.
    # Its all-to-all token dispatcher (no weights) opens a CUDA stream for its token counts once per process: hand
    # it a stand-in, as CPU has no streams.
    with torch.device("meta"), mock.patch("torch.cuda.current_device", return_value="meta"), \
            mock.patch("megatron.core.transformer.multi_latent_attention.HAVE_TE", False), \
            mock.patch.object(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", object()):
        return GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=vocab_size,
            max_sequence_length=max_positions,
            share_embeddings_and_output_weights=not untie,
            position_embedding_type=position_embedding_type,
            rotary_percent=rotary_percent,
            rotary_base=rotary_base,
            rope_scaling=rope_scaling,
            mtp_block_spec=mtp,
        )


def _weightless_core_attention(spec):
    """The spec with latent attention's core attention (softmax(QK^T)V, no weights) as a weightless stand-in:
    MLASelfAttention passes it k_channels and v_channels, which only Transformer Engine's attention takes
    (megatron-core's local DotProductAttention refuses them, and Transformer Engine needs CUDA). Every weight is
    in the projections and norms, which stay megatron-core's own."""
    layers = spec.layer_specs if hasattr(spec, "layer_specs") else [spec]
    for layer in layers:
        layer.submodules.self_attention.submodules.core_attention = IdentityOp
    return spec


def single_rank(config: TransformerConfig) -> TransformerConfig:
    """The same model on one rank: the total, not one shard."""
    return dataclasses.replace(config, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                               sequence_parallel=False, num_layers_in_first_pipeline_stage=None,
                               num_layers_in_last_pipeline_stage=None, pipeline_model_parallel_layout=None,
                               virtual_pipeline_model_parallel_size=None, use_cpu_initialization=True,
                               perform_initialization=False)


def megatron_lm_model(plan: Plan) -> GPTModel:
    ns = parse(megatron.megatron_args(plan))
    validate_like_megatron_lm(ns)
    return megatron_core_model(single_rank(transformer_config(ns)), plan.architecture.vocab_size,
                               ns.max_position_embeddings, ns.untie_embeddings_and_output_weights,
                               ns.position_embedding_type, ns.rotary_percent, ns.rotary_base, ns.use_rope_scaling)


def count(model: torch.nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


# ---------------------------------------------------------------------------------------------------------------
# Megatron-LM


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_megatron_lm_builds_the_planned_model(one_rank, name):
    plan = tiny_plan(name)
    model = megatron_lm_model(plan)
    assert count(model) == planned_params(plan)
    arch = plan.architecture
    names = [parameter_name for parameter_name, _ in model.named_parameters()]
    assert any(n.endswith("linear_qkv.bias") for n in names) == (arch.qkv_bias or arch.linear_bias)
    assert any(n.endswith("linear_fc1.bias") for n in names) == arch.linear_bias
    assert any(n.endswith("input_layernorm.bias") for n in names) == (arch.normalization == "layernorm")
    assert ("embedding.position_embeddings.weight" in names) == (arch.position_embedding == "learned")
    assert ("output_layer.weight" in names) == (not arch.tied_embeddings)
    if arch.position_embedding == "rope":
        rotary = model.rotary_pos_emb
        head_dim = arch.hidden_size // arch.num_attention_heads
        assert rotary.inv_freq.shape[0] * 2 == int(head_dim * arch.rotary_percent)
        assert model.rotary_base == arch.rope_theta
        assert model.rotary_scaling == (arch.rope_scaling is not None)


@pytest.mark.parametrize("name", PRESETS)
def test_megatron_lm_builds_each_presets_parameter_count(one_rank, name):
    plan = preset_plan(name)
    exact = count(megatron_lm_model(plan))
    assert exact == model_preset(name).total_params
    # Megatron-LM pads the tokenizer's vocabulary to a multiple of 128 x tp: still within 0.1% at tp 8
    padded_vocab = -(-plan.architecture.vocab_size // (128 * 8)) * 128 * 8
    tables = 1 if plan.architecture.tied_embeddings else 2
    padded = exact + tables * (padded_vocab - plan.architecture.vocab_size) * plan.architecture.hidden_size
    assert padded == pytest.approx(exact, rel=1e-3)


def test_megatron_lm_refuses_rope_scaling_it_would_run_differently():
    plan = tiny_plan("llama31-like")
    scaling = plan.architecture.rope_scaling.model_copy(update={"factor": 32.0})  # Llama 3.2 1B/3B
    llama32 = plan.model_copy(update={"architecture": plan.architecture.model_copy(update={"rope_scaling": scaling})})
    with pytest.raises(ExportError, match="does not pass --rope-scaling-factor on"):
        megatron.megatron_args(llama32)


def test_megatron_lm_refuses_a_fractional_rope_base():
    plan = tiny_plan("qwen2-like")
    odd = plan.model_copy(update={"architecture": plan.architecture.model_copy(update={"rope_theta": 10000.5})})
    with pytest.raises(ExportError, match="RoPE base 10000.5 is not a whole number"):
        megatron.megatron_args(odd)


def test_megatron_without_the_architecture_flags_builds_another_model(one_rank):
    """The check is live: Megatron-LM's defaults (LayerNorm, learned positions, biases) are a different count."""
    plan = tiny_plan("llama31-like")
    flags = megatron.megatron_args(plan)
    kept = []
    skip = {"--normalization": 1, "--norm-epsilon": 1, "--position-embedding-type": 1, "--rotary-base": 1,
            "--disable-bias-linear": 0, "--use-rope-scaling": 0, "--rope-scaling-factor": 1}
    words = iter(flags)
    for word in words:
        if word in skip:
            for _ in range(skip[word]):
                next(words)
            continue
        kept.append(word)
    ns = parse(kept)
    model = megatron_core_model(single_rank(transformer_config(ns)), plan.architecture.vocab_size,
                                ns.max_position_embeddings, ns.untie_embeddings_and_output_weights,
                                ns.position_embedding_type, ns.rotary_percent, ns.rotary_base, ns.use_rope_scaling)
    assert count(model) != planned_params(plan)


# ---------------------------------------------------------------------------------------------------------------
# Megatron-DeepSpeed (flag definitions copied from microsoft/Megatron-DeepSpeed megatron/arguments.py)


def megatron_deepspeed_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    add = parser.add_argument
    add("--num-layers", type=int, default=None)
    add("--hidden-size", type=int, default=None)
    add("--ffn-hidden-size", type=int, default=None)
    add("--num-attention-heads", type=int, default=None)
    add("--num-key-value-heads", type=int, default=None)
    add("--max-position-embeddings", type=int, default=None)
    add("--use-rotary-position-embeddings", action="store_true")
    add("--rotary-position-embeddings-theta", type=int, default=10000, dest="rope_theta")
    add("--rotary-percent", type=float, default=1.0)
    add("--no-position-embedding", action="store_false", dest="add_position_embedding")
    add("--normalization", type=str, default="layernorm", choices=["layernorm", "rmsnorm"])
    add("--layernorm-epsilon", type=float, default=1e-5)
    add("--swiglu", action="store_true")
    add("--untie-embeddings-and-output-weights", action="store_true")
    add("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    return parser


def megatron_deepspeed_model(args: list[str], vocab_size: int) -> GPTModel:
    ns = megatron_deepspeed_parser().parse_args(args)
    kv_heads = ns.num_key_value_heads or ns.num_attention_heads  # its validate_args default
    config = TransformerConfig(
        num_layers=ns.num_layers, hidden_size=ns.hidden_size, ffn_hidden_size=ns.ffn_hidden_size,
        num_attention_heads=ns.num_attention_heads, num_query_groups=kv_heads,
        normalization="RMSNorm" if ns.normalization == "rmsnorm" else "LayerNorm",
        layernorm_epsilon=ns.layernorm_epsilon, add_bias_linear=ns.add_bias_linear,
        gated_linear_unit=ns.swiglu, activation_func=F.silu if ns.swiglu else F.gelu,
        use_cpu_initialization=True, perform_initialization=False,
    )
    if ns.use_rotary_position_embeddings:
        assert not ns.add_position_embedding, "rotary and a learned table at once"
        positions = "rope"
    else:
        positions = "learned_absolute" if ns.add_position_embedding else "none"
    return megatron_core_model(config, vocab_size, ns.max_position_embeddings,
                               ns.untie_embeddings_and_output_weights, positions, ns.rotary_percent, ns.rope_theta,
                               rope_scaling=False)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_megatron_deepspeed_flags_build_the_planned_model_or_say_why_not(one_rank, name):
    plan = tiny_plan(name)
    section = ds_export.document(plan)[ds_export.RESIPLAN_KEY]["megatron_deepspeed"]
    arch = plan.architecture
    if (arch.rope_scaling is not None or (arch.qkv_bias and not arch.linear_bias) or arch.attention_sinks
            or arch.sliding_window is not None):
        assert section["args"] is None
        assert "Megatron-DeepSpeed cannot build this model" in section["cannot_build"]
        return
    assert count(megatron_deepspeed_model(section["args"], arch.vocab_size)) == planned_params(plan)


# ---------------------------------------------------------------------------------------------------------------
# torchtitan


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_torchtitan_builds_the_planned_model_or_refuses(name):
    plan = tiny_plan(name)
    arch = plan.architecture
    if arch.attention_sinks:  # torchtitan has sinks in its GPT-OSS model only, whose attention shape it fixes
        with pytest.raises(ExportError, match="torchtitan cannot build this model: attention other than GPT-OSS's"):
            model_config(arch)
        return
    if arch.normalization != "rmsnorm" or not arch.swiglu:
        with pytest.raises(ExportError, match="torchtitan cannot build this model") as refused:
            llama3_model_config(arch)
        assert "layernorm" in str(refused.value) and "non-gated MLP" in str(refused.value)
        return
    config = llama3_model_config(arch)
    with torch.device("meta"):
        model = config.build()
    assert count(model) == planned_params(plan)
    layer = config.layers[0]
    assert (layer.attention.rope.theta, layer.attention_norm.eps) == (arch.rope_theta, arch.norm_epsilon)
    assert layer.attention.rope.scaling == ("llama" if arch.rope_scaling else "none")
    assert config.enable_weight_tying == arch.tied_embeddings


@pytest.mark.parametrize("name", ["llama3-8b", "llama3.1-70b", "qwen2.5-7b", "qwen3-8b", "qwen3-30b-a3b",
                                  "qwen3-235b-a22b", "gpt-oss-20b", "gpt-oss-120b", "deepseek-v2-lite", "deepseek-v3"])
def test_torchtitan_builds_each_presets_parameter_count(name):
    config = model_config(preset_plan(name).architecture)
    with torch.device("meta"):
        model = config.build()
    spec = model_preset(name)
    assert count(model) == spec.total_params
    if spec.num_experts:  # its grouped experts: num_experts x (gate, up, down) of one expert's width
        experts = model.layers[str(spec.num_layers - 1)].moe.routed_experts
        assert sum(p.numel() for p in experts.parameters()) == spec.routed_expert_params_per_layer
    if spec.qk_norm:
        assert model.layers["0"].attention.q_norm.weight.numel() == (spec.head_dim or spec.hidden_size // spec.num_attention_heads)


@pytest.mark.parametrize(("name", "named"), [("mixtral-8x7b", "a mixture of 8 experts without query/key norms"),
                                             ("qwen2-57b-a14b", "a mixture of 64 experts without query/key norms")])
def test_torchtitan_refuses_a_mixture_it_has_no_model_for(name, named):
    with pytest.raises(ExportError, match=named):
        model_config(preset_plan(name).architecture)


def test_torchtitan_refuses_what_its_qwen3_decoder_does_not_build():
    arch = preset_plan("qwen3-30b-a3b").architecture
    with pytest.raises(ExportError, match="shared experts"):
        model_config(arch.model_copy(update={"shared_expert_ffn_hidden_size": 4096}))
    with pytest.raises(ExportError, match="biases on the projections"):
        model_config(arch.model_copy(update={"qkv_bias": True}))
    with pytest.raises(ExportError, match="query/key norms"):
        llama3_model_config(arch)


def test_a_plan_stored_before_architecture_details_is_not_exported_with_guesses():
    """A stored plan whose architecture lacks the RoPE base and norms would get defaults (RoPE 10000 for Llama 3)."""
    stored = json.loads(tiny_plan("llama31-like").model_dump_json())
    for field in ("normalization", "norm_epsilon", "position_embedding", "rope_theta", "rotary_percent",
                  "rope_scaling", "max_position_embeddings", "qkv_bias", "linear_bias"):
        del stored["architecture"][field]
    old = Plan.model_validate(stored)
    assert old.architecture.rope_theta == 10_000.0  # the default a guess would use
    with pytest.raises(ExportError, match="stored before plans recorded linear_bias, norm_epsilon, normalization"):
        megatron.megatron_args(old)
    section = ds_export.document(old)[ds_export.RESIPLAN_KEY]["megatron_deepspeed"]
    assert section["args"] is None and "plan it again" in section["cannot_build"]


def test_sequences_longer_than_the_learned_position_table_are_refused():
    plan = tiny_plan("gpt3-like")  # 2,048 rows, 2,048-token sequences
    short = plan.model_copy(update={"architecture": plan.architecture.model_copy(update={"max_position_embeddings": 1024})})
    for export in (megatron.megatron_args, ds_export.document):
        with pytest.raises(ExportError, match="sequences of 2048 tokens are longer than the model's learned position "
                                              r"table \(1024 rows\)"):
            export(short)


def test_megatron_core_runs_the_windows_and_sinks_the_plan_priced(one_rank, monkeypatch):
    """The exported --softmax-type, --window-size and --window-attn-skip-freq, as megatron-core 0.16 reads them:
    each layer windowed exactly where the plan's model has a window (its own is_layer_window_attention), every
    query of a windowed layer seeing `sliding_window` keys (its own mask, built here on CPU), and one learned
    softmax offset per head in every layer's attention (the sinks the parameter count includes)."""
    from megatron.core.transformer import utils as core_utils

    plan = tiny_plan("sinks-windows-like")
    arch = plan.architecture
    ns = parse(megatron.megatron_args(plan))
    validate_like_megatron_lm(ns)
    config = transformer_config(ns)
    assert config.softmax_type == "learnable"
    model = resolve_model(arch)
    windowed = [core_utils.is_layer_window_attention(config.window_size, config.window_attn_skip_freq, n)
                for n in range(1, arch.num_layers + 1)]
    assert sum(windowed) == model.windowed_layers > 0
    assert windowed == [(i + 1) % arch.full_attention_every != 0 for i in range(arch.num_layers)]
    real_ones = torch.ones
    monkeypatch.setattr(core_utils.torch, "ones", lambda *shape, **kwargs: real_ones(
        *shape, **{k: v for k, v in kwargs.items() if k != "device"}))
    seq = 512
    masked = core_utils.get_sliding_window_causal_mask(seq, seq, config.window_size)
    seen = (~masked).sum(dim=1)
    assert seen[-1].item() == arch.sliding_window and seen[:arch.sliding_window].tolist() == list(
        range(1, arch.sliding_window + 1))
    built = megatron_lm_model(plan)
    offsets = [p for name, p in built.named_parameters() if name.endswith("softmax_offset")]
    assert len(offsets) == arch.num_layers and all(p.numel() == arch.num_attention_heads for p in offsets)


# ---------------------------------------------------------------------------------------------------------------
# Latent attention and dense layers among the experts (DeepSeek-V2/V3)


@functools.cache
def latent_plan(q_lora_rank: int = 64) -> Plan:
    request = small_request(model={**LATENT, "q_lora_rank": q_lora_rank, "name": "latent-like"},
                            cluster={"num_nodes": 1, "gpus_per_node": 8, "gpu": "H100-SXM"},
                            options={"time_limit_s": 2, "allow_non_uniform": False})
    return plan_for(PlanRequest.model_validate(request))


@pytest.mark.parametrize("q_lora_rank", [64, 0])
def test_megatron_lm_builds_latent_attention_with_dense_and_expert_layers(one_rank, q_lora_rank):
    plan = latent_plan(q_lora_rank)
    ns = parse(megatron.megatron_args(plan))
    validate_like_megatron_lm(ns)
    config = transformer_config(ns)
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim,
            config.v_head_dim) == (q_lora_rank or None, 48, 32, 16, 24)
    assert (config.rope_type, config.rotary_scaling_factor, config.mscale, config.mscale_all_dim) == ("yarn", 40.0, 1.0, 1.0)
    assert (config.original_max_position_embeddings, config.beta_fast, config.beta_slow) == (4096, 32, 1)
    model = megatron_lm_model(plan)
    assert count(model) == planned_params(plan)
    names = [name for name, _ in model.named_parameters()]
    layer_mlps = [{name.split(".")[4] for name in names if name.startswith(f"decoder.layers.{i}.mlp.")} for i in range(4)]
    assert layer_mlps[0] == {"linear_fc1", "linear_fc2"}  # the dense layer
    assert all({"router", "experts", "shared_experts"} <= mlp for mlp in layer_mlps[1:])
    assert any("self_attention.kv_layernorm" in name for name in names)
    assert any("self_attention.q_layernorm" in name for name in names) == bool(q_lora_rank)
    assert model.decoder.layers[0].mlp.linear_fc1.weight.shape[0] == 2 * 320  # gate and up of the dense width
    assert model.mtp.layers[0].eh_proj.weight.shape == (256, 2 * 256)  # the multi-token-prediction depth


def test_megatron_lm_builds_deepseek_v3_at_its_parameter_count(one_rank):
    """682,636,472,320 weights: the DeepSeek-V3 report's 671B and its multi-token-prediction depth (one expert
    layer, a 2h x h projection and three norms: 11.6B; its checkpoint's 14B adds copies of the embedding and head)."""
    plan = preset_plan("deepseek-v3")
    spec = model_preset("deepseek-v3")
    assert count(megatron_lm_model(plan)) == spec.total_params == 682_636_472_320
    assert spec.total_params - spec.mtp_params == 671_026_404_352


def test_megatron_lm_refuses_latent_attention_yarn_it_would_run_differently():
    plan = latent_plan()
    scaling = plan.architecture.rope_scaling.model_copy(update={"original_max_position_embeddings": 8192})
    other = plan.model_copy(update={"architecture": plan.architecture.model_copy(update={"rope_scaling": scaling})})
    with pytest.raises(ExportError, match="latent attention runs RoPE plain or as YaRN with"):
        megatron.megatron_args(other)


def test_torchtitan_builds_latent_attention_with_dense_and_expert_layers():
    arch = latent_plan().architecture
    config = model_config(arch)
    with torch.device("meta"):
        model = config.build()
    assert count(model) == planned_params(latent_plan())
    first, last = model.layers["0"], model.layers["3"]
    assert not hasattr(first, "moe") and first.feed_forward.w1.weight.shape == (320, 256)
    assert not hasattr(last, "feed_forward") and last.moe.shared_experts.w1.weight.shape == (96, 256)
    assert (last.attention.wq_a.weight.shape, last.attention.wkv_a.weight.shape) == ((64, 256), (48 + 16, 256))
    assert config.layers[0].attention.mscale == 1.0 and config.layers[0].attention.rope.rope_factor == 40.0


def test_torchtitan_refuses_latent_attention_it_would_run_differently():
    arch = latent_plan().architecture
    scaling = arch.rope_scaling.model_copy(update={"mscale_all_dim": 0.5})
    with pytest.raises(ExportError, match="YaRN with mscale equal to mscale_all_dim"):
        model_config(arch.model_copy(update={"rope_scaling": scaling}))
    with pytest.raises(ExportError, match="shared experts of the same width"):
        model_config(arch.model_copy(update={"shared_expert_ffn_hidden_size": 100}))
