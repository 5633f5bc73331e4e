"""Every layout a user can estimate either exports to a command line the real framework accepts, or is refused
by the export with its reason: never a command line the framework rejects.

The hand-picked cases of tests/adapters/test_torchtitan.py and test_megatron.py follow what the search picks and
what recipes publish; this crosses the degrees instead (tp, cp, pp and its schedule, ep, ZeRO stage, hybrid
sharding, recompute, precision) on 16 H100s, dense and mixture-of-experts, drawn with a fixed seed. It found
that torchtitan refuses CUDA graphs under expert parallelism with its all-to-all dispatcher, which only the
pipelined EP cases had turned off.

torchtitan: `ConfigManager().parse_args` over the overrides (its config validation, Trainer.Config's included).
Megatron-LM: its argument parser for the emitted flags and the rules of `validate_args` that concern them
(tests/adapters/test_megatron.py's copies). DeepSpeed: `DeepSpeedConfig(document, mpu=grid)` on the fake process
group, as `deepspeed.initialize` parses it (tests/adapters/test_deepspeed.py's world).
"""

from __future__ import annotations

import copy
import itertools
import random

import pydantic
import pytest

from adapters import megatron
from adapters.registry import ExportError
from adapters.torchtitan import override_argv
from api.tasks.planning import estimate_for
from planner.errors import InfeasibleError, PlanningError
from tests.adapters.test_deepspeed import DeepSpeedConfig, exported, grid_of, world  # noqa: F401 (world: a fixture)
from tests.adapters.test_megatron import parse as parse_megatron
from tests.adapters.test_megatron import validate_like_megatron_lm
from tests.adapters.test_torchtitan import parse as parse_torchtitan
from tests.api.support import estimate_request
from wire.schemas import EstimateRequest, Plan

CLUSTER = {"num_nodes": 2, "gpus_per_node": 8, "gpu": "H100-SXM"}
MODELS = ("llama3-8b", "qwen3-30b-a3b")
PIPELINES = ((1, "1f1b"), (2, "1f1b"), (2, "interleaved"), (2, "zb-h1"))  # (pp, schedule)
SEED = 20261205  # draws each layout's recompute and precision, which hardly interact with the degrees


def _all_layouts() -> list[tuple[str, dict, dict]]:
    """Every combination of the degrees; recompute and precision drawn per layout."""
    draw = random.Random(SEED)
    out = []
    for model, tp, cp, (pp, schedule), ep, zero, shard in itertools.product(
            MODELS, (1, 2), (1, 2), PIPELINES, (1, 4), (0, 1, 3), (None, 2)):
        if (ep > 1 and model == "llama3-8b") or (shard and zero == 0):
            continue
        layout = {"tp": tp, "cp": cp, "pp": pp, "ep": ep, "recompute": draw.choice(("none", "full")),
                  "micro_batch_size": 1}
        if pp > 1:
            layout["schedule"] = schedule
            if schedule == "interleaved":
                layout["virtual_stages"] = 2
        if shard:
            layout["dp_shard"] = shard
        training = {"global_batch_size": 32, "seq_length": 8192, "zero_stage": zero,
                    "precision": draw.choice(("bf16", "fp8"))}
        out.append((model, layout, training))
    return out


def _estimated(model: str, layout: dict, training: dict) -> Plan | None:
    """The plan of the layout, or None where the estimate itself refuses it (a 422: what cannot exist)."""
    try:
        return estimate_for(EstimateRequest.model_validate(estimate_request(
            layout, cluster=CLUSTER, model=model, training=training)))
    except (PlanningError, InfeasibleError):
        return None


@pytest.fixture(scope="module")
def plans() -> list[tuple[str, Plan]]:
    out = []
    for model, layout, training in _all_layouts():
        plan = _estimated(model, layout, training)
        if plan is not None:
            out.append((f"{model} {layout} zero {training['zero_stage']} {training['precision']}", plan))
    return out


def test_the_draw_covers_the_degrees(plans):
    """Enough of the layouts exist, and they vary every degree the matrix crosses."""
    assert len(plans) >= 40
    seen = {"tp": set(), "cp": set(), "pp": set(), "ep": set(), "zero": set(), "hybrid": set(), "precision": set()}
    for _, plan in plans:
        stage = plan.replicas[0].stages[0]
        seen["tp"].add(stage.tp)
        seen["cp"].add(stage.cp)
        seen["pp"].add(len(plan.replicas[0].stages))
        seen["ep"].add(plan.ep)
        seen["zero"].add(plan.zero_stage)
        seen["hybrid"].add(bool(plan.dp_shard) and plan.dp_shard < len(plan.replicas))
        seen["precision"].add(plan.precision)
    assert all(len(values) >= 2 for values in seen.values()), seen


def _outcomes(plans, export, accept, framework_errors) -> tuple[int, int, list[str]]:
    """(accepted, refused, rejected) over the plans: `export` raises ExportError to refuse one; `accept` runs the
    framework's own check on the export and raises one of `framework_errors` to reject it."""
    accepted, refused, rejected = 0, 0, []
    for name, plan in plans:
        try:
            exported_form = export(plan)
        except ExportError:
            refused += 1
            continue
        try:
            accept(plan, exported_form)
            accepted += 1
        except framework_errors as error:
            rejected.append(f"{name}: {error}")
    return accepted, refused, rejected


def test_torchtitan_accepts_every_export_it_is_given(plans):
    accepted, refused, rejected = _outcomes(plans, override_argv, parse_torchtitan, SystemExit)
    assert not rejected, f"torchtitan rejected exported command lines: {rejected}"
    assert accepted >= 50 and refused >= 1, (accepted, refused)  # 57 and 70 of the 127 layouts on 2026-12-05


def test_megatron_lm_accepts_every_export_it_is_given(plans):
    accepted, refused, rejected = _outcomes(plans, megatron.megatron_args,
                                            lambda _, args: validate_like_megatron_lm(parse_megatron(args)),
                                            (SystemExit, AssertionError))
    assert not rejected, f"Megatron-LM rejected exported command lines: {rejected}"
    assert accepted >= 80, (accepted, refused)  # 90 of the 127 on 2026-12-05


def test_deepspeed_accepts_every_export_it_is_given(plans, world):
    def accept(plan: Plan, document: dict) -> None:
        if document["resiplan"]["pipeline_module"] is None:  # the plain engine: data parallelism only
            world.enter(len(document["resiplan"]["rank_devices"]), 0)
            config = DeepSpeedConfig(copy.deepcopy(document))
        else:  # the PipelineEngine, whose grid DeepSpeed reads the data-parallel size from
            config = DeepSpeedConfig(copy.deepcopy(document), mpu=grid_of(world, document))
        assert config.train_batch_size == plan.global_batch_size

    accepted, refused, rejected = _outcomes(plans, exported, accept,
                                            (AssertionError, ValueError, pydantic.ValidationError))
    assert not rejected, f"DeepSpeed rejected exported configs: {rejected}"
    assert accepted >= 4, (accepted, refused)  # 4 of the 127 on 2026-12-05: DeepSpeed 0.19 runs no FP8, CP or hybrid sharding
