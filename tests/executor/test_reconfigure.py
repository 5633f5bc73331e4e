"""Live reconfiguration: one world of 8 gloo processes trains plan A, switches in place to the service's replan
B (GPU 0:1 failed, GPU 0:0 at half speed: a non-uniform plan) at step 2 and to the replan C (0:1 back) at step 4,
moving weights and Adam state by executing exactly each replan's `migration.transfers`.

Checked against one process training the whole batch with `torch.optim.Adam` (not the executor's sharded
Adam): every step's loss, and the final parameters. The byte counts are recomputed here from the model's
parameter counts, not from the executor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from api.tasks.planning import plan_for
from api.tasks.replanning import replan_for, replan_request
from executor import layout as executor_layout
from executor import model as executor_model
from executor import run as executor_run
from tests.executor.support import Case, losses, mismatches, replica_states, run_world, tiny
from wire.schemas import Plan, PlanRequest, ReplanRequest

STEPS = 6
SWITCHES = (2, 4)
LR = 1e-3  # Adam moves every weight by ~lr per step, far beyond the tolerances below
LOSS_TOLERANCE = 1e-4  # absolute, per step (the bar)
# Adam divides by sqrt(v): elements whose gradient is near zero amplify fp32 summation-order noise (at lr 1e-2
# the losses of a run without any switch drift from the reference by 1e-4 within 7 steps). At lr 1e-3 a correct
# run ends within 6.5e-5 of a tensor's scale; a rank that lagged in Adam's step count across a switch misses by
# up to 6e-3.
PARAM_TOLERANCE = 5e-4
WEIGHT_BYTES, MOMENT_BYTES = 4, 8  # fp32 parameters; Adam's two fp32 moments

REQUEST = {
    "cluster": {"num_nodes": 4, "gpus_per_node": 2, "gpu": "A100-40GB"},
    "model": {"num_layers": 12, "hidden_size": 4096, "ffn_hidden_size": 16384, "num_attention_heads": 32,
              "num_kv_heads": 8, "vocab_size": 32000, "swiglu": True, "tied_embeddings": False},
    # ZeRO-0: every data-parallel replica holds the whole optimizer state, so a lost GPU's share survives.
    "training": {"global_batch_size": 32, "seq_length": 4096, "zero_stage": 0},
    "options": {"time_limit_s": 2, "schedules": ["interleaved"]},
}
FAILED, SLOW = "0:1", "0:0"


def _devices(plan: Plan) -> set[str]:
    return {d for r in plan.replicas for s in r.stages for d in s.devices}


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    a = plan_for(PlanRequest.model_validate(REQUEST))
    degraded = {"failures": {"failed": [FAILED], "slow": [{"device": SLOW, "speed": 0.5}]}}
    b = replan_for(replan_request(REQUEST, ReplanRequest.model_validate(degraded)), a, "plan-b")
    c = replan_for(replan_request(REQUEST, ReplanRequest.model_validate({"failures": {}})), b, "plan-c")
    return {"A": tiny(a), "B": tiny(b), "C": tiny(c)}


@pytest.fixture(scope="module")
def switched(plans, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reconfigure")
    options = executor_run.Options(steps=STEPS, lr=LR, optimizer="adam")
    case = Case("abc", plans["A"].model_dump_json(), options, str(out / "abc"),
                reconfigure=((SWITCHES[0], plans["B"].model_dump_json()), (SWITCHES[1], plans["C"].model_dump_json())))
    run_world([case], len(executor_layout.world_devices(list(plans.values()))), out)
    return out / "abc"


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_plans_are_what_the_test_claims(plans):
    a, b, c = plans["A"], plans["B"], plans["C"]
    assert a.uniform and _devices(a) == {f"{n}:{g}" for n in range(4) for g in range(2)}
    assert not b.uniform and FAILED not in _devices(b) and SLOW in _devices(b)
    assert len({r.num_microbatches for r in b.replicas}) == 2  # unequal microbatches
    assert FAILED in _devices(c)  # the recovered GPU rejoins
    assert b.migration.bytes_from_checkpoint == 0 and b.migration.transfers and c.migration.transfers


def test_live_switches_train_like_one_process(plans, switched):
    a = plans["A"]
    ref_losses, _, ref_final = executor_model.reference_train(
        executor_model.model_config(a), a.global_batch_size, STEPS, 0, LR, "adam")
    got = losses(switched)
    assert len(got) == STEPS
    for step, (x, y) in enumerate(zip(got, ref_losses, strict=True)):
        assert abs(x - y) <= LOSS_TOLERANCE, f"step {step}: loss {x} != reference {y}"
    states = replica_states(switched)
    assert sorted(states) == sorted(r.id for r in plans["C"].replicas)
    for replica, state in states.items():
        problems = mismatches(state, ref_final, PARAM_TOLERANCE)
        assert not problems, f"replica {replica}: " + "; ".join(problems)
    records = _jsonl(switched / "losses.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    expected_ids = [a.plan_id] * 2 + [plans["B"].plan_id] * 2 + [plans["C"].plan_id] * 2
    assert [r["plan_id"] for r in records] == expected_ids
    assert [r["loss"] for r in records] == got


def _unit_params(plan: Plan) -> dict[int, int]:
    """Parameters per migration unit of the executor's model: 0 the embedding, 1..L layers, L + 1 norm + head."""
    cfg = executor_model.model_config(plan)
    model = executor_model.Chunk(cfg, range(cfg.num_layers), True, True, 0)
    counts: dict[int, int] = {}
    for name, param in model.named_parameters():
        if name.startswith("layers."):
            unit = int(name.split(".")[1]) + 1
        else:
            unit = 0 if name.startswith("embed") else cfg.num_layers + 1
        counts[unit] = counts.get(unit, 0) + param.numel()
    return counts


def _expected_bytes(transfer: dict, counts: dict[int, int], num_layers: int) -> int:
    first = 0 if transfer["embedding"] else transfer["layers"][0] + 1
    end = num_layers + 2 if transfer["head"] else transfer["layers"][1] + 1
    lo, hi, of = transfer["part"]
    per_param = WEIGHT_BYTES * ("weights" in transfer["state"]) + MOMENT_BYTES * ("optimizer" in transfer["state"])
    elements = sum(counts[unit] for unit in range(first, end)) * (hi - lo)
    assert elements % of == 0
    return elements // of * per_param


@pytest.mark.parametrize("switch", [0, 1], ids=["A->B", "B->C"])
def test_executed_transfers_are_the_plans(plans, switched, switch):
    target = plans["BC"[switch]]
    step = SWITCHES[switch]
    events = [e for e in _jsonl(switched / "events.jsonl") if e["step"] == step]
    (reconfigure,) = [e for e in events if e["event"] == "reconfigure"]
    assert reconfigure["to_plan"] == target.plan_id and reconfigure["transfers"] == len(target.migration.transfers)
    assert reconfigure["transfers_s"] > 0
    executed = sorted((e for e in events if e["event"] == "transfer"), key=lambda e: e["index"])
    planned = [t.model_dump(mode="json", by_alias=True) for t in target.migration.transfers]
    keys = ("from", "to", "layers", "embedding", "head", "tp_shard", "part", "state")
    assert [{k: e[k] for k in keys} for e in executed] == [{k: t[k] for k in keys} for t in planned]
    assert [e["plan_bytes"] for e in executed] == [t["bytes"] for t in planned]
    counts, num_layers = _unit_params(target), target.architecture.num_layers
    assert [e["bytes"] for e in executed] == [_expected_bytes(t, counts, num_layers) for t in planned]


def test_a_migration_missing_state_stops_every_rank(plans, tmp_path):
    """Negative control: B's transfers without the optimizer state leave receivers' Adam moments unset."""
    b = plans["B"]
    weights_only = [t.model_copy(update={"state": ["weights"]}) for t in b.migration.transfers]
    broken = b.model_copy(update={"migration": b.migration.model_copy(update={"transfers": weights_only})})
    options = executor_run.Options(steps=3, lr=LR, optimizer="adam")
    case = Case("broken", plans["A"].model_dump_json(), options, str(tmp_path / "broken"),
                reconfigure=((SWITCHES[0], broken.model_dump_json()),))
    # Every rank raises (the first to be joined is reported, by rank 0 or as a child's ProcessRaisedException).
    with pytest.raises(Exception, match="optimizer state .* no transfer delivered"):
        run_world([case], len(executor_layout.world_devices([plans["A"], b])), tmp_path, seconds=60)


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints: A writes sharded checkpoints, B (another layout, one device fewer) resumes from the newest


@pytest.fixture(scope="module")
def resumed(plans, tmp_path_factory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("checkpoint")
    checkpoints = out / "checkpoints"
    save = Case("save", plans["A"].model_dump_json(),
                executor_run.Options(steps=4, lr=LR, optimizer="adam", checkpoint_every=2,
                                     checkpoint_dir=str(checkpoints)), str(out / "save"))
    resume = Case("resume", plans["B"].model_dump_json(),
                  executor_run.Options(steps=STEPS, lr=LR, optimizer="adam", resume=str(checkpoints)),
                  str(out / "resume"))
    run_world([save, resume], len(executor_layout.world_devices([plans["A"]])), out)
    return checkpoints, out / "resume"


def test_a_checkpoint_resumes_on_another_plan(plans, resumed):
    checkpoints, out = resumed
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000002", "step-000004"]
    assert sorted(p.name for p in (checkpoints / "step-000004").iterdir()) == sorted(
        [d.replace(":", "_") + ".pt" for d in _devices(plans["A"])] + ["complete.json"])
    a = plans["A"]
    ref_losses, _, ref_final = executor_model.reference_train(
        executor_model.model_config(a), a.global_batch_size, STEPS, 0, LR, "adam")
    records = _jsonl(out / "losses.jsonl")
    assert [r["step"] for r in records] == [4, 5] and {r["plan_id"] for r in records} == {plans["B"].plan_id}
    for record in records:
        assert abs(record["loss"] - ref_losses[record["step"]]) <= LOSS_TOLERANCE, record
    for replica, state in replica_states(out).items():
        problems = mismatches(state, ref_final, PARAM_TOLERANCE)
        assert not problems, f"replica {replica}: " + "; ".join(problems)
    (event,) = [e for e in _jsonl(out / "events.jsonl") if e["event"] == "resume"]
    assert event["step"] == 4 and event["checkpoint"].endswith("step-000004")


def test_resume_without_a_complete_checkpoint_is_refused(plans, tmp_path, capsys):
    from executor.cli import main

    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plans["A"].model_dump_json())
    (tmp_path / "step-000002").mkdir()  # written, never completed
    assert main(["--plan", str(plan_file), "--resume", str(tmp_path), "--steps", "4"]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# ZeRO-1: Adam's moments sharded over the replicas; a slow GPU (no failure, so nothing is lost) makes the service
# move A1 (4 replicas of one TP-2 stage) to a non-uniform B1 (pipelines of TP-1 stages), moving ZeRO-1 shards.


@pytest.fixture(scope="module")
def zero1(tmp_path_factory) -> tuple[Plan, Plan, Path]:
    body = {**REQUEST, "training": {**REQUEST["training"], "zero_stage": 1}}
    a = plan_for(PlanRequest.model_validate(body))
    slow = {"failures": {"slow": [{"device": SLOW, "speed": 0.5}]}}
    b = replan_for(replan_request(body, ReplanRequest.model_validate(slow)), a, "plan-b-zero1")
    a, b = tiny(a), tiny(b)
    out = tmp_path_factory.mktemp("zero1")
    case = Case("zero1", a.model_dump_json(), executor_run.Options(steps=4, lr=LR, optimizer="adam"),
                str(out / "zero1"), reconfigure=((SWITCHES[0], b.model_dump_json()),))
    run_world([case], len(executor_layout.world_devices([a, b])), out)
    return a, b, out / "zero1"


def test_zero1_state_moves_live(zero1):
    a, b, out = zero1
    assert a.zero_stage == b.zero_stage == 1 and not b.uniform and b.migration.bytes_from_checkpoint == 0
    assert any("optimizer" in t.state and t.part[2] > max(s.tp for r in a.replicas for s in r.stages)
               for t in b.migration.transfers)  # pieces finer than a TP shard: ZeRO-1 shares
    ref_losses, _, ref_final = executor_model.reference_train(
        executor_model.model_config(a), a.global_batch_size, 4, 0, LR, "adam")
    for step, (x, y) in enumerate(zip(losses(out), ref_losses, strict=True)):
        assert abs(x - y) <= LOSS_TOLERANCE, f"step {step}: loss {x} != reference {y}"
    for replica, state in replica_states(out).items():
        problems = mismatches(state, ref_final, PARAM_TOLERANCE)
        assert not problems, f"replica {replica}: " + "; ".join(problems)
    executed = sorted((e for e in _jsonl(out / "events.jsonl") if e["event"] == "transfer"), key=lambda e: e["index"])
    planned = [t.model_dump(mode="json", by_alias=True) for t in b.migration.transfers]
    keys = ("from", "to", "layers", "embedding", "head", "tp_shard", "part", "state")
    assert [{k: e[k] for k in keys} for e in executed] == [{k: t[k] for k in keys} for t in planned]
    counts = _unit_params(b)
    assert [e["bytes"] for e in executed] == [_expected_bytes(t, counts, b.architecture.num_layers) for t in planned]
