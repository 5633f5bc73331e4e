"""DeepSpeed settings read back (issue 21): the configs `adapters.deepspeed` writes for the real plans of
`test_deepspeed.py` import to the same layout and model, alone (through the export's "resiplan" key) and as a
user runs them, the config beside Megatron-DeepSpeed's own flags."""

from __future__ import annotations

import shlex

import pytest

from adapters.command_line import CommandLineError
from adapters.deepspeed import document
from adapters.deepspeed_import import import_deepspeed
from tests.adapters.test_deepspeed import CASE_IDS, plan_of


def _expected(plan) -> dict:
    first = plan.replicas[0]
    split = [stage.layers[1] - stage.layers[0] for stage in first.stages]
    return {"tp": first.stages[0].tp, "pp": len(first.stages), "dp": len(plan.replicas), "split": split,
            "micro_batch_size": plan.micro_batch_size, "recompute": plan.recompute}


@pytest.mark.parametrize("name", CASE_IDS)
def test_the_exported_config_imports_to_the_same_layout_and_model(name):
    plan = plan_of(name)
    imported = import_deepspeed(document(plan))
    expected, layout = _expected(plan), imported.request["layout"]
    assert (layout["tp"], layout["pp"], layout["dp"], layout["micro_batch_size"], layout["recompute"]) == (
        expected["tp"], expected["pp"], expected["dp"], expected["micro_batch_size"], expected["recompute"])
    assert layout.get("layers_per_stage", [expected["split"][0]] * expected["pp"]) == expected["split"]
    training = imported.request["training"]
    # bf16 training accumulates bf16 gradients in DeepSpeed unless ZeRO-1 asks its BF16_Optimizer for fp32
    bf16_grads = plan.precision == "bf16" and (plan.grad_precision == "bf16" or plan.zero_stage != 1)
    assert training == {"global_batch_size": plan.global_batch_size, "seq_length": plan.seq_length,
                        "zero_stage": plan.zero_stage, "precision": plan.precision,
                        **({"grad_precision": "bf16"} if bf16_grads else {})}
    assert imported.request["model"] == plan.architecture.model_dump(exclude={"name"})


@pytest.mark.parametrize("name", ["healthy-70b-tp4-pp4-dp2", "full-recompute-mbs2-tp2-pp4-dp4", "fp16-zero0"])
def test_a_config_beside_megatron_deepspeed_flags(name):
    """What a user runs: the DeepSpeed config (no "resiplan" key) and Megatron-DeepSpeed's flags, in its own
    spellings, for the model; the batch, precision, ZeRO stage and recompute come from the config."""
    plan = plan_of(name)
    exported = document(plan)
    config = {key: value for key, value in exported.items() if key != "resiplan"}
    settings = exported["resiplan"]
    flags = ["--tensor-model-parallel-size", str(settings["tensor_parallel"]["size"]),
             "--pipeline-model-parallel-size", str(settings["pipeline_module"]["num_stages"]),
             *settings["megatron_deepspeed"]["args"], "--seq-length", str(plan.seq_length)]
    imported = import_deepspeed(config, shlex.join(["deepspeed", "pretrain_gpt.py", *flags]),
                                vocab_size=plan.architecture.vocab_size)
    layout = imported.request["layout"]
    expected = _expected(plan)
    assert (layout["tp"], layout["pp"], layout["dp"], layout["micro_batch_size"]) == (
        expected["tp"], expected["pp"], expected["dp"], expected["micro_batch_size"])
    model = plan.architecture.model_dump(exclude={"name"})
    for key, value in imported.request["model"].items():
        assert model[key] == value, (key, model[key], value)
    assert imported.request["training"]["precision"] == plan.precision


def test_zero_3_is_mapped_and_unknown_keys_are_reported():
    config = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 8,
              "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "optimizer": {"type": "Adam"},
              "sparse_attention": {"mode": "fixed"}}
    args = ("pretrain_gpt.py --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 "
            "--swiglu --normalization rmsnorm --use-rotary-position-embeddings --no-position-embedding "
            "--seq-length 4096 --untie-embeddings-and-output-weights --disable-bias-linear")
    imported = import_deepspeed(config, args)
    assert imported.request["layout"]["dp"] == 8 and imported.request["model"]["vocab_size"] == 32000
    reported = " ".join(imported.not_modelled)
    assert imported.request["training"]["zero_stage"] == 3
    assert "zero_optimization" not in reported and "sparse_attention" in reported
    assert "optimizer" in imported.ignored


def test_a_zero_stage_deepspeed_lacks_is_refused():
    config = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 8,
              "zero_optimization": {"stage": 4}, "bf16": {"enabled": True}}
    with pytest.raises(CommandLineError, match="zero_optimization.stage 4: DeepSpeed's ZeRO stages are 0, 1, 2 and 3"):
        import_deepspeed(config, "pretrain_gpt.py --num-layers 32 --hidden-size 4096 --num-attention-heads 32 "
                                 "--seq-length 4096 --vocab-size 32000")


def test_a_config_alone_does_not_say_the_model():
    with pytest.raises(CommandLineError, match="Megatron-DeepSpeed command line"):
        import_deepspeed({"train_batch_size": 8, "bf16": {"enabled": True}})
