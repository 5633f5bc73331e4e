"""Megatron-LM command lines read back (issue 21): the Llama 3 8B example Megatron-LM publishes, the round trip
export -> import on the real plans `test_megatron.py` exports, and pasted shell text."""

from __future__ import annotations

import shlex

import pytest

from adapters.megatron import launch_command, megatron_args
from adapters.megatron_import import CommandLineError, import_megatron
from api.tasks.planning import estimate_for
from cost_models.model_spec import model_preset
from tests.adapters.test_megatron import PLANS, real_plan
from wire.schemas import EstimateRequest

# Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh as its torchrun line expands with its defaults
# (mock data; one node of 8 GPUs), pasted with its quoting and line continuations.
LLAMA3_8B_EXAMPLE = r"""
torchrun --nproc_per_node 8 --nnodes 1 --node_rank 0 --master_addr localhost --master_port 6000 \
    examples/classes/pretrain_gpt.py \
    --use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 \
    --group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 \
    --max-position-embeddings 8192 --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 \
    --attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --init-method-std 0.0134 --attention-backend fused \
    --apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear \
    --micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000 --lr-decay-samples 1949218748 \
    --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 \
    --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 \
    --grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc \
    --empty-unused-memory-level 1 --exit-duration-in-mins 235 \
    --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather \
    --tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel \
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather \
    --mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --data-cache-path "${PWD}/benchmark_cache" \
    --tiktoken-pattern v2 --split '99,1,0' --no-create-attention-mask-in-dataloader --no-mmap-bin-files \
    --num-workers 1 --log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput \
    --profile --profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60 \
    --save "checkpoints/llama3_8b_fp8" --load "checkpoints/llama3_8b_fp8" --tensorboard-dir "tensorboard_logs/x"
"""

SHAPE = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_kv_heads", "vocab_size")


def test_megatrons_llama3_8b_example_is_the_llama3_8b_preset_shape_and_the_flags_layout():
    imported = import_megatron(LLAMA3_8B_EXAMPLE)
    model, preset = imported.request["model"], model_preset("llama3-8b")
    assert {key: model[key] for key in SHAPE} == {key: getattr(preset, key) for key in SHAPE}
    assert imported.request["layout"] == {"tp": 1, "pp": 1, "dp": 8, "micro_batch_size": 1, "virtual_stages": 1,
                                          "schedule": "1f1b", "recompute": "none"}
    # NVIDIA's script reduces gradients in bf16 (--grad-reduce-in-bf16): priced, 2 bytes a gradient
    assert imported.request["training"] == {"global_batch_size": 128, "seq_length": 8192, "zero_stage": 1,
                                            "precision": "fp8", "grad_precision": "bf16"}
    # The script builds LayerNorm (it never says --normalization RMSNorm) with a RoPE base of 1e6: what runs.
    assert (model["normalization"], model["rope_theta"], model["swiglu"], model["tied_embeddings"]) == (
        "layernorm", 1e6, True, False)
    reported = " ".join(imported.not_modelled)
    assert "--fp8-param-gather" in reported and "--grad-reduce-in-bf16" not in reported
    assert "--fp8-format" not in reported  # FP8 training is priced
    assert "overlap" not in reported  # both data-parallel overlaps are priced as the script sets them
    assert {"--fp8-amax-history-len", "--fp8-amax-compute-algo"} <= set(imported.ignored)  # scaling: numerics
    assert "--context-parallel-size" not in reported, "context parallelism 1 changes nothing"
    assert {"--lr", "--save", "--tokenizer-type", "--split"} <= set(imported.ignored)
    # Every flag is mapped, reported or ignored: none dropped silently.
    flags = {word for word in shlex.split(LLAMA3_8B_EXAMPLE.replace("\\\n", " ")) if word.startswith("--")}
    script_flags = flags - {"--nproc_per_node", "--nnodes", "--node_rank", "--master_addr", "--master_port"}
    accounted = set(imported.ignored) | {entry.split(":")[0].split(" ")[0] for entry in imported.not_modelled}
    mapped = script_flags - accounted
    assert mapped <= MAPPED_FLAGS, f"flags neither mapped, reported nor ignored: {mapped - MAPPED_FLAGS}"


# What the importer maps into the request (the module's table), written out here so that a flag it drops
# fails the test above.
MAPPED_FLAGS = {
    "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--group-query-attention",
    "--num-query-groups", "--kv-channels", "--seq-length", "--max-position-embeddings", "--position-embedding-type",
    "--rotary-base", "--rotary-percent", "--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--micro-batch-size", "--global-batch-size", "--bf16", "--tensor-model-parallel-size", "--sequence-parallel",
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--vocab-size", "--fp8-format",
    "--grad-reduce-in-bf16",
    "--context-parallel-size",  # at 1: no context parallelism, as the model runs it
    "--attention-backend",  # fused: Transformer Engine's cuDNN attention, the default attention_kernel's price
}


def _stock_plan(name: str):
    """A real plan and its Megatron-LM flags: every plan of test_megatron.py exports, so each must round-trip."""
    plan = real_plan(name)
    return plan, megatron_args(plan)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_export_then_import_gives_the_same_layout_and_model(name):
    plan, args = _stock_plan(name)
    arch = plan.architecture
    imported = import_megatron(shlex.join(["pretrain_gpt.py", *args]), vocab_size=arch.vocab_size)
    layout, training, model = (imported.request[key] for key in ("layout", "training", "model"))
    first = plan.replicas[0]
    split = [stage.layers[1] - stage.layers[0] for stage in first.stages]
    assert (layout["tp"], layout["pp"], layout["virtual_stages"]) == (first.stages[0].tp, len(first.stages),
                                                                      plan.virtual_stages)
    assert layout.get("cp", 1) == first.stages[0].cp
    assert layout.get("ep", 1) == plan.ep
    assert layout.get("etp") == plan.etp
    assert layout.get("layers_per_stage", [arch.num_layers // len(split)] * len(split)) == split
    p, v = len(first.stages), plan.virtual_stages
    if any(stage.chunk_layers is not None for stage in first.stages):  # uneven model chunks, in virtual-stage order
        assert layout["layers_per_chunk"] == [first.stages[i % p].chunk_layers[i // p] for i in range(p * v)]
    else:
        assert "layers_per_chunk" not in layout or len(set(split)) > 1
    assert (layout["micro_batch_size"], layout["recompute"]) == (plan.micro_batch_size, plan.recompute)
    assert layout["schedule"] == ("interleaved" if plan.virtual_stages > 1 else "1f1b")
    bf16_grads = {"grad_precision": "bf16"} if plan.grad_precision == "bf16" else {}
    flex = {"moe_dispatcher": "flex"} if plan.moe_dispatcher == "flex" else {}
    overlap = {"moe_a2a_overlap": True} if plan.moe_a2a_overlap else {}
    tp_overlap = {"tp_comm_overlap": "megatron"} if plan.tp_comm_overlap == "megatron" else {}
    assert training == {"global_batch_size": plan.global_batch_size, "seq_length": plan.seq_length,
                        "zero_stage": plan.zero_stage, "precision": plan.precision, **bf16_grads, **flex, **overlap,
                        **tp_overlap}
    exported = arch.model_dump(exclude={"name"})
    for key, value in model.items():
        if key == "rope_scaling":
            assert {k: v for k, v in exported[key].items() if k != "rope_type"} == value
        else:
            assert exported[key] == value, (key, exported[key], value)
    assert imported.not_modelled == [] or all("--use-tp-pp-dp-mapping" not in entry for entry in imported.not_modelled)
    assert not [entry for entry in imported.not_modelled if "not a flag resiplan knows" in entry]


@pytest.mark.parametrize("name", ["healthy-interleaved-70b", "gqa-llama3-8b", "recompute-full-layout", "uneven-chunks"])
def test_the_imported_launch_command_estimates_to_the_plans_prediction(name):
    """The launch command (torchrun, then the script) imported and estimated on the plan's cluster predicts what
    the plan predicted: the same layout, model and replica count, priced by the same model."""
    plan, _ = _stock_plan(name)
    imported = import_megatron(launch_command(plan), vocab_size=plan.architecture.vocab_size)
    assert imported.request["layout"]["dp"] == len(plan.replicas)
    cluster = {"num_nodes": 1 + max(int(d.split(":")[0]) for r in plan.replicas for s in r.stages for d in s.devices),
               "gpus_per_node": 8, "gpu": "A100-80GB"}  # these three plans' GPUs
    body = {**imported.request, "cluster": cluster}
    estimate = estimate_for(EstimateRequest.model_validate(body))
    assert estimate.predicted.iteration_time_s == pytest.approx(plan.predicted.iteration_time_s, rel=2e-3)


def test_a_context_parallel_launch_command_estimates_to_the_plans_prediction():
    """--context-parallel-size travels back as layout.cp: the imported layout on the plan's H100s predicts what
    the plan (llama3-8b at 64k tokens, which the search gives CP) predicted."""
    plan, _ = _stock_plan("context-parallel-64k")
    assert plan.replicas[0].stages[0].cp > 1
    imported = import_megatron(launch_command(plan), vocab_size=plan.architecture.vocab_size)
    assert imported.request["layout"]["cp"] == plan.replicas[0].stages[0].cp
    cluster = {"num_nodes": 2, "gpus_per_node": 8, "gpu": "H100-SXM"}
    estimate = estimate_for(EstimateRequest.model_validate({**imported.request, "cluster": cluster}))
    assert estimate.predicted.iteration_time_s == pytest.approx(plan.predicted.iteration_time_s, rel=2e-3)


@pytest.mark.parametrize("name", ["zero3-hybrid", "zero1-partial-instances"])
def test_hybrid_sharding_launch_command_estimates_to_the_plans_prediction(name):
    """--num-distributed-optimizer-instances travels back as layout.dp_shard (dp / instances, dp from torchrun's
    ranks): the imported layout predicts what the plan predicted, Megatron-FSDP's HSDP and the partial
    distributed optimizer alike."""
    plan, args = _stock_plan(name)
    assert plan.dp_shard < len(plan.replicas)
    imported = import_megatron(launch_command(plan), vocab_size=plan.architecture.vocab_size)
    assert imported.request["layout"]["dp_shard"] == plan.dp_shard
    assert not [entry for entry in imported.not_modelled if "instances" in entry or "outer" in entry]
    gpu = "H100-SXM" if name == "zero3-hybrid" else "A100-80GB"
    cluster = {"num_nodes": 4, "gpus_per_node": 8, "gpu": gpu}
    estimate = estimate_for(EstimateRequest.model_validate({**imported.request, "cluster": cluster}))
    assert estimate.dp_shard == plan.dp_shard
    assert estimate.predicted.iteration_time_s == pytest.approx(plan.predicted.iteration_time_s, rel=2e-3)
    # without a launcher the replica count, and so the shard group, is unknown: said, not guessed
    bare = import_megatron(shlex.join(["pretrain_gpt.py", *args]), vocab_size=plan.architecture.vocab_size)
    assert "dp_shard" not in bare.request["layout"]
    assert any("replica count is unknown" in entry for entry in bare.not_modelled)


def test_the_embedding_and_the_loss_counted_as_layers_give_megatron_cores_chunks():
    """Megatron-Bridge's Llama 3.1 405B recipe (pp 8, vp 8) splits 126 layers + the embedding + the loss into 64
    slots of 2: megatron-core's own split (TransformerConfig with the same flags) is what the import estimates."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    flags = ["--num-layers", "126", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "4096",
             "--max-position-embeddings", "4096", "--tensor-model-parallel-size", "1",
             "--pipeline-model-parallel-size", "8", "--num-virtual-stages-per-pipeline-rank", "8",
             "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
             "--micro-batch-size", "1", "--global-batch-size", "64", "--bf16", "--use-distributed-optimizer",
             "--overlap-grad-reduce", "--overlap-param-gather"]
    imported = import_megatron(shlex.join(["pretrain_gpt.py", *flags]), vocab_size=32000)
    chunks = imported.request["layout"]["layers_per_chunk"]
    assert chunks == [1] + [2] * 62 + [1]
    assert not [entry for entry in imported.not_modelled if "account-for" in entry]
    config = TransformerConfig(num_layers=126, hidden_size=512, num_attention_heads=8, pipeline_model_parallel_size=8,
                               virtual_pipeline_model_parallel_size=8, account_for_embedding_in_pipeline_split=True,
                               account_for_loss_in_pipeline_split=True, pipeline_dtype=torch.bfloat16, bf16=True)
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    built = [get_num_layers_to_build(config, vp_stage=part // 8, pp_rank=part % 8) for part in range(64)]
    assert built == chunks
    with pytest.raises(CommandLineError, match="do not split evenly"):
        import_megatron(shlex.join(["pretrain_gpt.py", *flags[:1], "125", *flags[2:]]), vocab_size=32000)


def test_shell_quoting_continuations_and_equals_forms():
    text = ("python pretrain_gpt.py --num-layers=4 --hidden-size 256 \\\n --num-attention-heads '4' "
            '--seq-length "128" --global-batch-size 8 --bf16 --vocab-size 1000  # --fp16 is a comment')
    imported = import_megatron(text)
    assert imported.request["model"]["num_layers"] == 4
    assert imported.request["training"]["precision"] == "bf16"
    # Megatron-LM's defaults where a flag is absent: LayerNorm, learned positions, biases, tied embeddings, GELU.
    model = imported.request["model"]
    assert (model["normalization"], model["position_embedding"], model["linear_bias"], model["tied_embeddings"],
            model["swiglu"]) == ("layernorm", "learned", True, True, False)


@pytest.mark.parametrize("overlaps, missing", [
    ("", ["--overlap-grad-reduce", "--overlap-param-gather"]),
    ("--overlap-grad-reduce", ["--overlap-param-gather"]),
    ("--overlap-grad-reduce --overlap-param-gather", []),
])
def test_a_data_parallel_overlap_the_command_leaves_off_is_reported(overlaps, missing):
    """The cost model prices both overlaps; a run without one is slower than estimated, and the import says so."""
    text = ("pretrain_gpt.py --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 128 "
            f"--global-batch-size 8 --vocab-size 1000 --bf16 --use-distributed-optimizer {overlaps}")
    reported = [entry for entry in import_megatron(text).not_modelled if "overlap" in entry]
    assert [entry.split(":")[0] for entry in reported] == [f"no {flag}" for flag in missing]


@pytest.mark.parametrize("text, fragment", [
    ("pretrain_gpt.py --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 128 "
     "--global-batch-size 8 --vocab-size 10", "neither --bf16 nor --fp16"),
    ("pretrain_gpt.py --hidden-size 256 --num-attention-heads 4 --bf16", "no --num-layers"),
    ("pretrain_gpt.py --num-layers 4 --hidden-size 'unclosed", "does not parse as a shell would"),
    ("pretrain_gpt.py --num-layers 4 --hidden-size 300 --num-attention-heads 4 --seq-length 128 "
     "--global-batch-size 8 --bf16", "no model preset has this shape"),
])
def test_what_cannot_be_imported_says_why(text, fragment):
    with pytest.raises(CommandLineError, match=fragment):
        import_megatron(text)


def test_attention_sinks_and_windows_round_trip():
    """--softmax-type learnable, --window-size W-1,0 and --window-attn-skip-freq k read back as the plan's attention
    sinks, W-key windows and every k-th layer full; other softmax types and windows are reported, not guessed."""
    from tests.adapters.test_model_exports import tiny_plan

    plan = tiny_plan("sinks-windows-like")
    arch = plan.architecture
    imported = import_megatron(shlex.join(["pretrain_gpt.py", *megatron_args(plan)]), vocab_size=arch.vocab_size)
    model = imported.request["model"]
    assert (model["attention_sinks"], model["sliding_window"], model["full_attention_every"]) == (
        True, arch.sliding_window, arch.full_attention_every)
    assert not imported.not_modelled
    base = shlex.join(["pretrain_gpt.py", *megatron_args(plan)])
    other = import_megatron(base.replace("--softmax-type learnable", "--softmax-type off-by-one")
                            .replace("--window-size 127,0", "--window-size 127,4"), vocab_size=arch.vocab_size)
    assert "attention_sinks" not in other.request["model"] and "sliding_window" not in other.request["model"]
    assert {entry.split(" ")[0] for entry in other.not_modelled} >= {"--softmax-type", "--window-size"}


@pytest.mark.parametrize("q_lora_rank", [64, 0])
def test_latent_attention_and_dense_layers_round_trip_and_estimate_to_the_plans_prediction(q_lora_rank):
    """--multi-latent-attention with its widths and YaRN, and --moe-layer-freq "([0]*k+[1]*(L-k))", read back as the
    plan's architecture; the launch command estimates to the plan's prediction on its cluster."""
    from tests.adapters.test_model_exports import latent_plan

    plan = latent_plan(q_lora_rank)
    arch = plan.architecture
    imported = import_megatron(launch_command(plan), vocab_size=arch.vocab_size)
    model = imported.request["model"]
    keys = ("kv_lora_rank", "q_lora_rank", "head_dim", "qk_rope_head_dim", "v_head_dim", "dense_layers",
            "dense_ffn_hidden_size", "mtp_layers")
    assert {key: model.get(key, 0) for key in keys} == {key: getattr(arch, key) for key in keys}
    assert arch.mtp_layers == 1
    assert model["rope_scaling"] == arch.rope_scaling.model_dump(exclude={"low_freq_factor", "high_freq_factor"})
    assert "qk_norm" not in model and not imported.notes and not imported.not_modelled
    body = {**imported.request, "cluster": {"num_nodes": 1, "gpus_per_node": 8, "gpu": "H100-SXM"}}
    estimate = estimate_for(EstimateRequest.model_validate(body))
    assert estimate.predicted.iteration_time_s == pytest.approx(plan.predicted.iteration_time_s, rel=2e-3)


@pytest.mark.parametrize(("freq", "reported"), [("2", True), ("'([1]*3+[0]*1)'", True), ("'[0]*99999999999'", True),
                                                ("'([0]*1+[1]*3)'", False)])
def test_a_layer_pattern_other_than_dense_layers_first_is_reported_never_evaluated(freq, reported):
    from tests.adapters.test_model_exports import latent_plan

    plan = latent_plan()
    text = shlex.join(["pretrain_gpt.py", *megatron_args(plan)])
    text = text.replace("--moe-layer-freq '([0]*1+[1]*3)'", f"--moe-layer-freq {freq}")
    imported = import_megatron(text, vocab_size=plan.architecture.vocab_size)
    assert any(entry.startswith("--moe-layer-freq") for entry in imported.not_modelled) == reported
    assert ("dense_layers" in imported.request["model"]) == (not reported)


@pytest.mark.parametrize(("replacement", "reported"), [
    ("--moe-token-dispatcher-type alltoall", None),
    ("", "--moe-token-dispatcher-type allgather: gathers every token"),
    ("--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep", None),
])
def test_a_token_dispatcher_the_cost_model_does_not_price_is_reported(replacement, reported):
    """The export names the all-to-all dispatcher the plan prices; a command without it runs megatron-core's
    all-gather dispatcher, which is reported; the flex one (DeepEP or HybridEP) is read as moe_dispatcher flex."""
    plan, args = _stock_plan("moe-expert-parallel")
    text = shlex.join(["pretrain_gpt.py", *args]).replace("--moe-token-dispatcher-type alltoall", replacement)
    imported = import_megatron(text, vocab_size=plan.architecture.vocab_size)
    found = [entry for entry in imported.not_modelled if entry.startswith("--moe-token-dispatcher-type")]
    assert imported.request["training"].get("moe_dispatcher") == ("flex" if "flex" in replacement else None)
    if reported is None:
        assert found == []
    else:
        assert len(found) == 1 and found[0].startswith(reported)


def test_the_ep_overlap_is_read_back_and_reported_where_megatron_core_would_refuse_it():
    """--overlap-moe-expert-parallel-comm reads as training.moe_a2a_overlap; on a pipeline without virtual stages
    (which megatron-core's TransformerConfig refuses) it is reported, and the estimate prices the all-to-alls
    exposed."""
    plan, args = _stock_plan("moe-a2a-overlap")
    text = shlex.join(["pretrain_gpt.py", *args])
    imported = import_megatron(text, vocab_size=plan.architecture.vocab_size)
    assert imported.request["training"]["moe_a2a_overlap"] is True
    assert not [entry for entry in imported.not_modelled if entry.startswith("--overlap-moe-expert-parallel-comm")]
    chunked = "--num-virtual-stages-per-pipeline-rank 2"
    assert chunked in text
    flat = import_megatron(text.replace(chunked, "--num-virtual-stages-per-pipeline-rank 1"),
                           vocab_size=plan.architecture.vocab_size)
    assert [entry for entry in flat.not_modelled if entry.startswith("--overlap-moe-expert-parallel-comm")]


@pytest.mark.parametrize(("backend", "reported"), [
    ("fused", None), ("auto", None),
    ("flash", 'set training.attention_kernel "fa2"'),
    ("unfused", "scores materialized"), ("local", "scores materialized"),
])
def test_the_attention_backend_is_priced_as_fused_or_reported(backend, reported):
    """Transformer Engine's cuDNN attention (fused, auto) is what the default attention_kernel prices; the flash
    backend may be FlashAttention-2, which the request can say, and unfused attention is not a request field."""
    imported = import_megatron(LLAMA3_8B_EXAMPLE.replace("--attention-backend fused", f"--attention-backend {backend}"))
    assert "attention_kernel" not in imported.request["training"]
    lines = [line for line in imported.not_modelled if line.startswith("--attention-backend")]
    if reported is None:
        assert lines == []
    else:
        assert len(lines) == 1 and reported in lines[0]
