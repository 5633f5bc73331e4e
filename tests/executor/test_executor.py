"""The reference executor trains planned layouts, uniform and not, to the numbers of one process.

One world of 7 gloo processes (this one and 6 forked) runs four cases in turn: a uniform plan, a
non-uniform plan, the non-uniform plan again with replicas averaged equally (the negative control),
and a two-replica plan with a slowed rank writing telemetry. A torchrun test drives the command line.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field

from api.tasks.detection import detect_for
from api.tasks.planning import estimate_for, plan_for
from api.tasks.telemetry_body import parse_detect_body
from executor import layout as executor_layout
from executor import model as executor_model
from executor import run as executor_run
from executor.timing import Slowdown
from tests.executor.support import (
    LR,
    REQUESTS,
    Case,
    losses,
    mismatches,
    relative_error,
    replica_states,
    run_world,
    tiny,
    used_devices,
)
from wire.schemas import EstimateRequest, Plan, PlanRequest

TOLERANCE = 1e-5  # relative, fp32
STEPS = 3
SLOW_FACTOR = 4.0
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    return {name: tiny(estimate_for(EstimateRequest.model_validate(body)) if "layout" in body
                       else plan_for(PlanRequest.model_validate(body))) for name, body in REQUESTS.items()}


SLOW_RANK = 1
TP_SLOW_STEPS, TP_SLOW_FACTOR = 4, 3.0


def _tp_partner(plan: Plan) -> str:
    """The second device of the plan's first tensor-parallel stage."""
    return next(s.devices[1] for r in plan.replicas for s in r.stages if s.tp == 2)


@pytest.fixture(scope="module")
def runs(plans, tmp_path_factory) -> dict[str, Case]:
    tmp = tmp_path_factory.mktemp("executor")
    uniform, non_uniform = plans["uniform"].model_dump_json(), plans["non-uniform"].model_dump_json()
    slow_device = executor_layout.build_layout(plans["telemetry"]).devices[SLOW_RANK]
    options = executor_run.Options
    cases = [
        Case("uniform", uniform, options(steps=STEPS, lr=LR), str(tmp / "uniform"), str(tmp / "uniform.jsonl")),
        Case("non-uniform", non_uniform, options(steps=STEPS, lr=LR), str(tmp / "non-uniform")),
        Case("unweighted", non_uniform, options(steps=1, lr=LR, grad_weighting="uniform"), str(tmp / "unweighted")),
        Case("tp-slow", uniform, options(steps=TP_SLOW_STEPS, lr=LR, slowdowns=(Slowdown(_tp_partner(plans["uniform"]),
                                                                                 TP_SLOW_FACTOR),)),
             str(tmp / "tp-slow"), str(tmp / "tp-slow.jsonl")),
        Case("uneven-chunks", plans["uneven-chunks"].model_dump_json(), options(steps=STEPS, lr=LR),
             str(tmp / "uneven-chunks")),
        Case("telemetry", plans["telemetry"].model_dump_json(),
             options(steps=STEPS, lr=LR, slowdowns=(Slowdown(slow_device, SLOW_FACTOR),)), str(tmp / "telemetry"),
             str(tmp / "telemetry.jsonl")),
    ]
    run_world(cases, max(used_devices(plan) for plan in plans.values()), tmp)
    return {case.name: case for case in cases}


def _reference(plan: Plan, steps: int = STEPS):
    layout = executor_layout.build_layout(plan)
    return executor_model.reference_train(executor_model.model_config(plan), layout.global_batch_size, steps, 0, LR)


def _assert_trains_like_one_process(plan: Plan, out_dir: str, steps: int = STEPS) -> None:
    ref_losses, initial, ref_final = _reference(plan, steps)
    got = losses(out_dir)
    assert len(got) == steps
    for step, (a, b) in enumerate(zip(got, ref_losses, strict=True)):
        assert abs(a - b) <= TOLERANCE * abs(b), f"step {step}: loss {a} != reference {b}"
    states = replica_states(out_dir)
    assert sorted(states) == sorted(r.id for r in plan.replicas)
    for replica, state in states.items():
        problems = mismatches(state, ref_final, TOLERANCE)
        assert not problems, f"replica {replica}: " + "; ".join(problems)
    # Training moved the weights well beyond the tolerance, so the comparison above means something.
    moved = statistics.median(relative_error(ref_final[name], initial[name]) for name in ref_final)
    assert moved > 100 * TOLERANCE, f"SGD barely moved the parameters ({moved:.1e}); the test would be blind"


# ---------------------------------------------------------------------------------------------------------------
# The plans are what the tests claim


def test_uniform_plan_shape(plans):
    """Two replicas of layers [0,3) at tp 1 on node 0 + [3,8) at tp 2 on node 1, 4 microbatches, ZB-H2 (named)."""
    plan = plans["uniform"]
    assert plan.uniform and len(plan.replicas) == 2 and used_devices(plan) <= 8
    assert [stage.tp for stage in plan.replicas[0].stages] == [1, 2]  # TP changes along the pipeline
    ops = plan.pipeline_schedule.replicas[0].stages[1].ops
    assert any(op.startswith("I") for op in ops) and any(op.startswith("W") for op in ops)  # zero-bubble I/W


def test_non_uniform_plan_shape(plans):
    """Today: replica 0 = layers [0,4) at tp 1 on the failed GPU's node + [4,12) at tp 2, 6 microbatches; two
    single-stage tp-2 replicas with 5 each; four interleaved chunks per stage. What the test needs of it: replicas
    that differ in TP, in layer split and in microbatches, interleaved."""
    plan = plans["non-uniform"]
    assert not plan.uniform and len(plan.replicas) >= 2 and used_devices(plan) <= 8
    assert len({min(s.tp for s in r.stages) for r in plan.replicas}) > 1  # one replica runs a stage at lower TP
    splits = [tuple(s.layers[1] - s.layers[0] for s in r.stages) for r in plan.replicas]
    assert len(set(splits)) > 1 and any(len(set(split)) > 1 for split in splits)  # uneven layer splits
    assert len({r.num_microbatches for r in plan.replicas}) >= 2  # unequal microbatches
    assert plan.virtual_stages > 1  # interleaved: model chunks per rank


# ---------------------------------------------------------------------------------------------------------------
# Correctness against one process


def test_uniform_plan_trains_like_one_process(plans, runs):
    _assert_trains_like_one_process(plans["uniform"], runs["uniform"].out_dir)


def test_non_uniform_plan_trains_like_one_process(plans, runs):
    _assert_trains_like_one_process(plans["non-uniform"], runs["non-uniform"].out_dir)


def test_uneven_model_chunks_are_built_as_planned_and_train_like_one_process(plans, runs):
    """An estimate's layers_per_chunk [1, 3, 3, 1]: stage 0 runs chunks of 1 (with the embedding) and 3 layers,
    stage 1 chunks of 3 and 1 (with the head); the parts the executor builds hold exactly those layers."""
    plan = plans["uneven-chunks"]
    assert [stage.chunk_layers for stage in plan.replicas[0].stages] == [[1, 3], [3, 1]]
    parts = executor_layout.build_layout(plan).replicas[0].parts
    assert [list(part.layers) for part in parts] == [[0], [1, 2, 3], [4, 5, 6], [7]]
    _assert_trains_like_one_process(plan, runs["uneven-chunks"].out_dir)


def test_equal_replica_averaging_is_caught(plans, runs):
    """Negative control: averaging replicas equally (not by batch share) with 9 vs 7 microbatches is wrong."""
    plan = plans["non-uniform"]
    _, _, ref_final = _reference(plan, steps=1)
    with pytest.raises(AssertionError, match="relative error"):  # the step's loss comes before the update
        _assert_trains_like_one_process(plan, runs["unweighted"].out_dir, steps=1)
    worst = max(relative_error(state[name], ref_final[name])
                for state in replica_states(runs["unweighted"].out_dir).values() for name in ref_final)
    assert worst > 100 * TOLERANCE


# ---------------------------------------------------------------------------------------------------------------
# Telemetry


class MicrobatchTelemetry(BaseModel):
    """API.md's /v1/detect telemetry microbatch (wire/schemas.py has no wire model for it yet)."""

    model_config = ConfigDict(extra="forbid")
    seq_lengths: list[int] = Field(min_length=1)
    compute_ms: float = Field(ge=0)


class TelemetryItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    device: str = Field(pattern=r"^\d+:\d+$")
    iteration: int = Field(ge=0)
    microbatches: list[MicrobatchTelemetry]
    last_heartbeat_s_ago: float = Field(ge=0)


class DetectRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    plan_id: str
    telemetry: list[TelemetryItem]


def _telemetry(plan: Plan, path: str) -> list[TelemetryItem]:
    """Parsed as a /v1/detect request body, with one item per device and iteration that matches the plan."""
    lines = Path(path).read_text().splitlines()
    request = DetectRequest.model_validate({"plan_id": plan.plan_id, "telemetry": [json.loads(l) for l in lines]})
    devices = executor_layout.build_layout(plan).devices
    assert sorted((item.iteration, item.device) for item in request.telemetry) == sorted(
        (step, device) for step in range(STEPS) for device in devices
    )
    for item in request.telemetry:
        replica = next(r for r in plan.replicas if any(item.device in s.devices for s in r.stages))
        assert len(item.microbatches) == replica.num_microbatches
        assert all(mb.seq_lengths == [plan.seq_length] * plan.micro_batch_size for mb in item.microbatches)
        assert all(mb.compute_ms > 0 for mb in item.microbatches)
    return request.telemetry


def test_telemetry_of_a_tensor_parallel_plan(plans, runs):
    _telemetry(plans["uniform"], runs["uniform"].telemetry)


def test_slowed_rank_reports_the_slowdown(plans, runs):
    plan = plans["telemetry"]
    items = _telemetry(plan, runs["telemetry"].telemetry)
    slow, peer = (executor_layout.build_layout(plan).devices[rank] for rank in (SLOW_RANK, 1 - SLOW_RANK))
    assert [[s.devices for s in r.stages] for r in plan.replicas] == [[[peer]], [[slow]]]  # same work, one stage each
    median = {device: statistics.median(mb.compute_ms for item in items if item.device == device and item.iteration
                                        for mb in item.microbatches) for device in (slow, peer)}  # 0 warms up
    ratio = median[slow] / median[peer]
    # Wide bounds: on a shared 2-core VM an op's time varies by tens of percent, and a process waking from
    # its sleep computes a little slower (cold caches): measured 3.9..4.8 for 4x, while an unslowed pair
    # measures 0.9..1.1.
    assert 0.5 * SLOW_FACTOR < ratio < 2 * SLOW_FACTOR, (
        f"slowed rank took {ratio:.2f}x its peer (medians {median}), not ~{SLOW_FACTOR}x")
    _assert_trains_like_one_process(plan, runs["telemetry"].out_dir)  # a slow rank changes no number


def test_slow_tensor_parallel_device_is_detected_alone(plans, runs):
    """A GPU 3x slower from step 0 inside a TP-2 stage: /v1/detect flags it and not its TP partner, which waits
    for it in every collective (telemetry counts each device's own compute, not its waits)."""
    plan = plans["uniform"]
    slow = _tp_partner(plan)
    lines = Path(runs["tp-slow"].telemetry).read_text().splitlines()
    body = json.dumps({"plan_id": plan.plan_id, "telemetry": [json.loads(line) for line in lines]}).encode()
    found = detect_for(plan, parse_detect_body(body).telemetry)
    assert [f.device for f in found.fail_slow] == [slow], found
    assert 0.5 / TP_SLOW_FACTOR < found.fail_slow[0].speed < 2 / TP_SLOW_FACTOR
    assert found.fail_stop == []


# ---------------------------------------------------------------------------------------------------------------
# The command line under torchrun


def _cli_plan(schedules: list[str] | None = None) -> Plan:
    """Two replicas of the 4-layer model: a 2-stage pipeline whose stage 0 is on the higher rank, and one stage
    holding both interleaved chunks (PyTorch passes activations between them locally). `schedules`: the
    request's."""
    body = {
        "cluster": {"num_nodes": 2, "gpus_per_node": 4, "gpu": "A100-80GB"},
        "failures": {"failed": ["0:3"]},
        "model": {"num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
                  "num_kv_heads": 2, "vocab_size": 128, "swiglu": True, "tied_embeddings": False},
        "training": {"global_batch_size": 16, "seq_length": 32, "micro_batch_size": 1},
        "options": {"time_limit_s": 2, **({"schedules": schedules} if schedules else {})},
    }
    plan = plan_for(PlanRequest.model_validate(body))
    two = next(r for r in plan.replicas if len(r.stages) == 2)
    one = next(r for r in plan.replicas if len(r.stages) == 1)
    assert plan.virtual_stages == 2
    two = two.model_copy(deep=True)
    one = one.model_copy(deep=True)
    two.stages[0].devices, two.stages[1].devices, one.stages[0].devices = ["0:2"], ["0:1"], ["0:0"]
    gbs = (two.num_microbatches + one.num_microbatches) * plan.micro_batch_size
    return plan.model_copy(update={"replicas": [two, one], "global_batch_size": gbs})


@pytest.mark.parametrize("schedules", [None, ["looped-bfs"]], ids=["default", "looped-bfs"])
def test_command_line_under_torchrun(tmp_path, schedules):
    plan = _cli_plan(schedules)
    if schedules:
        assert {timeline.schedule for timeline in plan.pipeline_schedule.replicas} == {"looped-bfs"}
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.model_dump_json())
    layout = executor_layout.build_layout(plan)
    assert layout.replicas[0].leaders == [2, 1]  # the CSV rows must be permuted for PP-group ranks
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(layout.world), "-m", "executor.cli", "--plan", str(plan_file), "--steps", "2",
               "--lr", str(LR), "--out-dir", str(tmp_path / "out"), "--telemetry", str(tmp_path / "t.jsonl"),
               "--timeout", "60"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    assert printed["model"]["num_layers"] == 4 and len(printed["losses"]) == 2
    _assert_trains_like_one_process(plan, str(tmp_path / "out"), steps=2)
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 2 * layout.world


@pytest.mark.parametrize("stage", [2, 3])
def test_a_plan_sharding_gradients_or_weights_is_refused_naming_the_exports(plans, stage):
    """The executor shards Adam's moments only; running a ZeRO-2/3 plan as ZeRO-1 would not be that plan."""
    plan = plans["telemetry"].model_copy(update={"zero_stage": stage})
    with pytest.raises(ValueError, match=f"zero_stage {stage}.*optimizer state only.*megatron, deepspeed or torchtitan"):
        executor_layout.build_layout(plan)
    assert executor_layout.build_layout(plans["telemetry"])  # the same plan at its own stage builds
