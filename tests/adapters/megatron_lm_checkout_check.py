"""Opt-in, not collected by the suite (named outside test_*.py): the export through Megatron-LM's own parse_args, validate_args and gpt_builder.

Megatron-LM's training code (megatron/training, gpt_builders.py) is not on the package index; the other
Megatron tests re-implement the parts they need. With a checkout of the Megatron-LM tag matching the
installed megatron-core (core_v0.16.1 for 0.16.1) and its two extra imports (`pip install six regex`):

    RESIPLAN_MEGATRON_LM=/path/to/Megatron-LM pytest tests/adapters/megatron_lm_checkout_check.py

each plan's pretrain_gpt.py arguments (with the required settings filled in) pass Megatron-LM's own
parse_args and validate_args, its core_transformer_config_from_args gives the TransformerConfig the
re-implementation in test_megatron.py gives, and its gpt_builder builds the plan's parameter count.
CPU-only stand-ins: the GPU generation validate_args asks CUDA for is Hopper's, and the fused kernels a
CPU lacks (Transformer Engine RoPE, Apex layer norm and gradient fusion) are switched off by flag.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

from adapters import megatron
from tests.adapters import test_megatron, test_model_exports

CHECKOUT = os.environ.get("RESIPLAN_MEGATRON_LM")
pytestmark = [
    pytest.mark.skipif(not CHECKOUT, reason="set RESIPLAN_MEGATRON_LM to a Megatron-LM checkout to run"),
    pytest.mark.filterwarnings("ignore"),
]
FILLED = {"DATA_PATH": "/data/corpus_text_document", "TOKENIZER_TYPE": "HuggingFaceTokenizer",
          "TOKENIZER_MODEL": "gpt2", "TRAIN_ITERS": "10", "LR": "0.0003"}
CPU_ONLY = ["--no-rope-fusion", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
            "--transformer-impl", "local"]


@pytest.fixture(scope="module")
def megatron_lm():
    sys.path.insert(0, str(Path(CHECKOUT)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.training.arguments as arguments
        import megatron.training.global_vars as global_vars
        from gpt_builders import gpt_builder
    return arguments, global_vars, gpt_builder


def plans():
    return ([pytest.param(lambda n=name: test_megatron.real_plan(n), id=name) for name in test_megatron.PLANS]
            + [pytest.param(lambda n=name: test_model_exports.tiny_plan(n), id=name)
               for name in test_model_exports.ARCHITECTURES]
            + [pytest.param(lambda n=name: test_model_exports.preset_plan(n), id=name)
               for name in test_model_exports.PRESETS])


@pytest.mark.parametrize("make_plan", plans())
def test_megatron_lms_own_parser_validation_and_builder_take_the_export(megatron_lm, make_plan, monkeypatch,
                                                                         one_rank):
    arguments, global_vars, gpt_builder = megatron_lm
    plan = make_plan()
    args = megatron.megatron_args(plan)
    filled = [word for setting in megatron.REQUIRED for word in (setting.flag, FILLED[setting.variable])]
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *args, *filled, *CPU_ONLY])
    monkeypatch.setenv("WORLD_SIZE", str(len(megatron.rank_devices(plan))))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    ns = arguments.parse_args()
    arguments.validate_args(ns)
    config = arguments.core_transformer_config_from_args(ns)

    mine = test_megatron.parse(args)
    test_megatron.validate_like_megatron_lm(mine)
    ours = test_megatron.transformer_config(mine)
    compared = [f.name for f in dataclasses.fields(config) if f.name in vars(mine)]
    assert {name: getattr(config, name) for name in compared} == {name: getattr(ours, name) for name in compared}

    ns.padded_vocab_size = plan.architecture.vocab_size
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", ns)
    with torch.device("meta"):
        model = gpt_builder(ns, True, True, config=test_model_exports.single_rank(config))
    assert test_model_exports.count(model) == test_model_exports.planned_params(plan)


one_rank = test_model_exports.one_rank
