"""Fail-stop survival: 8 `resiplan-train --survive` processes (started by `executor.launch`, which, unlike
torchrun, lets the others run on when one dies) train a plan from a live service; `--fail-device` SIGKILLs
one device's process mid-step. The survivors must notice, form a world of 7, get the service's replan with
the device failed, take the lost state from the replicas that hold it (executing exactly the replan's
transfers) or, when no survivor holds it, from the newest checkpoint, and train on.

Checked against one process training the whole batch with torch.optim.Adam (not the executor's Adam): every
step's loss and the final parameters; the executed transfers against the replan's list, their bytes against a
recount from the model's parameter counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from adapters.client import PlannerClient
from api.app import create_app
from api.core.settings import Settings
from benchmarks import survival
from executor import model as executor_model
from tests.executor.support import mismatches, replica_states
from tests.executor.test_reconfigure import LOSS_TOLERANCE, PARAM_TOLERANCE, _expected_bytes, _unit_params
from tests.live_server import live_server
from wire.schemas import Plan

REPO = Path(__file__).resolve().parents[2]
STEPS, LR = 5, 1e-3
REQUEST = survival.REQUEST  # the benchmark's scenario (8 heads: see its comment)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _devices(plan: Plan) -> set[str]:
    return {d for r in plan.replicas for s in r.stages for d in s.devices}


def _survive(tmp: Path, body: dict, fail: str, extra: list[str] = ()) -> dict:
    """Plan `body` on a live service, train it with `fail` killed; what happened."""
    app = create_app(Settings(database_url=f"sqlite:///{tmp / 'store.db'}"))
    with live_server(app) as url, PlannerClient(url) as client:
        plan = client.plan(body)
        plan_file = tmp / "plan.json"
        plan_file.write_text(plan.model_dump_json())
        command = [sys.executable, "-m", "executor.launch", "--nproc-per-node", str(len(_devices(plan))),
                   "--log-dir", str(tmp / "logs"), "--plan", str(plan_file), "--steps", str(STEPS),
                   "--optimizer", "adam", "--lr", str(LR), "--server", url, "--survive", "--fail-device", fail,
                   "--timeout", "120", "--out-dir", str(tmp / "out"), *extra]
        done = subprocess.run(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                              text=True, timeout=600)
        logs = {p.name: p.read_text() for p in sorted((tmp / "logs").glob("rank*.log"))}
        assert done.returncode == 0, done.stderr[-3000:] + "".join(text[-3000:] for text in logs.values())
        events = _jsonl(tmp / "out" / "events.jsonl")
        (recovery,) = [e for e in events if e["event"] == "recovery"]
        replanned = client.get(recovery["plan_id"])
    return {"plan": plan, "replanned": replanned, "events": events, "recovery": recovery, "launcher": done.stderr,
            "failed": fail.split("@")[0],
            "logs": logs, "records": _jsonl(tmp / "out" / "losses.jsonl"), "out": tmp / "out"}


def _matches_one_process(run: dict) -> None:
    plan = run["plan"]
    reference, _, final = executor_model.reference_train(executor_model.model_config(plan), plan.global_batch_size,
                                                         STEPS, 0, LR, "adam")
    records = run["records"]
    assert [r["step"] for r in records] == list(range(STEPS))
    for record in records:
        expected = reference[record["step"]]
        assert abs(record["loss"] - expected) <= LOSS_TOLERANCE, (record, expected)
    states = replica_states(run["out"])
    assert sorted(states) == sorted(r.id for r in run["replanned"].replicas)
    for replica, state in states.items():
        problems = mismatches(state, final, PARAM_TOLERANCE)
        assert not problems, f"replica {replica}: " + "; ".join(problems)


# ---------------------------------------------------------------------------------------------------------------
# ZeRO-0: every replica holds the whole optimizer state, so what the lost GPU held survives elsewhere


FAILED, FAIL_STEP = "2:1", 2


@pytest.fixture(scope="module")
def survived(tmp_path_factory) -> dict:
    # Checkpoints only as the net for an evicted rank holding a last copy (see test_the_lost_state_came_...).
    return _survive(tmp_path_factory.mktemp("survive"), REQUEST, f"{FAILED}@{FAIL_STEP}", ["--checkpoint-every", "1"])


def _evicted(run: dict) -> list[str]:
    """Devices the survivors went on without besides the killed one (see executor/survival.py: a rank still
    blocked at the rendezvous deadline is evicted)."""
    return [d for d in run["recovery"]["lost"] if d != run["failed"]]


def test_the_killed_process_died_and_the_others_regrouped(survived):
    plan, recovery = survived["plan"], survived["recovery"]
    assert plan.uniform and plan.zero_stage == 0 and FAILED in _devices(plan)
    assert "were lost (killed by SIGKILL" in survived["launcher"]
    assert sum(f"device {FAILED}: killed at step {FAIL_STEP}" in text for text in survived["logs"].values()) == 1
    evicted = _evicted(survived)
    assert sum("it counts as lost and stops" in text for text in survived["logs"].values()) == len(evicted)
    assert recovery["step"] == FAIL_STEP and FAILED in recovery["lost"] and len(evicted) <= 1
    assert recovery["survivors"] == 8 - len(recovery["lost"])
    if not evicted:
        assert "from_checkpoint" not in recovery and recovery["next_step"] == FAIL_STEP  # the interrupted step


def test_the_service_replanned_without_the_lost_device(survived):
    plan, replanned, lost = survived["plan"], survived["replanned"], survived["recovery"]["lost"]
    assert replanned.parent_plan_id == plan.plan_id and set(lost) <= set(replanned.excluded_devices)
    assert not set(lost) & _devices(replanned) and len(_devices(replanned)) == 8 - len(lost)


def test_losses_through_the_loss_equal_one_process(survived):
    records, plan, replanned = survived["records"], survived["plan"], survived["replanned"]
    resumed = survived["recovery"]["next_step"]
    assert [r["plan_id"] for r in records] == [plan.plan_id] * resumed + [replanned.plan_id] * (STEPS - resumed)
    _matches_one_process(survived)


def test_the_lost_state_came_from_the_replicas_as_planned(survived):
    replanned, recovery = survived["replanned"], survived["recovery"]
    if "from_checkpoint" in recovery:
        # Only when an evicted rank held the last copy of some state; then the checkpoint had to serve.
        assert _evicted(survived) and replanned.migration.bytes_from_checkpoint > 0
        return
    assert replanned.migration.bytes_from_checkpoint == 0
    events = [e for e in survived["events"] if e["step"] == FAIL_STEP]
    executed = sorted((e for e in events if e["event"] == "transfer"), key=lambda e: e["index"])
    planned = [t.model_dump(mode="json", by_alias=True) for t in replanned.migration.transfers]
    keys = ("from", "to", "layers", "embedding", "head", "tp_shard", "part", "state")
    assert planned and [{k: e[k] for k in keys} for e in executed] == [{k: t[k] for k in keys} for t in planned]
    assert not set(recovery["lost"]) & {t["from"] for t in planned}
    counts, num_layers = _unit_params(replanned), replanned.architecture.num_layers
    assert [e["bytes"] for e in executed] == [_expected_bytes(t, counts, num_layers) for t in planned]
    # The lost GPU's TP shard reached its replacement from the other replica, weights and Adam's moments.
    assert any(set(t["state"]) == {"weights", "optimizer"} for t in planned)


# ---------------------------------------------------------------------------------------------------------------
# ZeRO-1: the lost GPU held the only copy of its share of Adam's moments, so the survivors read the checkpoint


@pytest.fixture(scope="module")
def from_checkpoint(tmp_path_factory) -> dict:
    body = {**REQUEST, "training": {**REQUEST["training"], "zero_stage": 1}}
    return _survive(tmp_path_factory.mktemp("survive-zero1"), body, "1:1@3", ["--checkpoint-every", "2"])


def test_state_no_survivor_holds_comes_from_the_checkpoint(from_checkpoint):
    plan, replanned, recovery = from_checkpoint["plan"], from_checkpoint["replanned"], from_checkpoint["recovery"]
    assert plan.zero_stage == 1 and replanned.migration.bytes_from_checkpoint > 0
    assert "1:1" in recovery["lost"] and len(_evicted(from_checkpoint)) <= 1
    assert recovery["from_checkpoint"].endswith("step-000002")
    assert "held by no survivor" in recovery["checkpoint_reason"] and recovery["next_step"] == 2
    assert not [e for e in from_checkpoint["events"] if e["event"] == "transfer"]
    records = from_checkpoint["records"]
    assert [r["plan_id"] for r in records] == [plan.plan_id] * 2 + [replanned.plan_id] * 3  # 2 and 3 run again
    _matches_one_process(from_checkpoint)


# ---------------------------------------------------------------------------------------------------------------
# The pieces


def test_shutting_connections_wakes_a_blocked_reader_and_spares_listeners():
    """In a child process: shut_connections() must be what wakes a rank blocked on a dead peer's socket."""
    script = textwrap.dedent("""
        import socket, threading
        from executor.survival import shut_connections
        listener = socket.create_server(("127.0.0.1", 0))
        client = socket.create_connection(listener.getsockname())
        server_side, _ = listener.accept()
        got = []
        reader = threading.Thread(target=lambda: got.append(server_side.recv(16)))
        reader.start()
        reader.join(0.5)
        assert reader.is_alive()  # blocked: nothing was sent
        shut = shut_connections()
        reader.join(5)
        assert not reader.is_alive() and got == [b""], got
        again = socket.create_connection(listener.getsockname())  # the listener still accepts
        print("shut", shut)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "shut 2"  # the two ends of the connection, not the listener


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    from api.tasks.planning import plan_for
    from wire.schemas import PlanRequest

    path = tmp_path_factory.mktemp("cli") / "plan.json"
    path.write_text(plan_for(PlanRequest.model_validate(REQUEST)).model_dump_json())
    return path


@pytest.mark.parametrize("args, message", [
    (["--survive"], "--survive needs --server"),
    (["--fail-device", "2:1"], "expected NODE:GPU@STEP"),
    (["--fail-device", "gpu3@2"], "expected NODE:GPU@STEP"),
])
def test_the_command_line_refuses_what_cannot_work(plan_file, capsys, args, message):
    from executor.cli import main

    assert main(["--plan", str(plan_file), *args]) == 2
    assert message in capsys.readouterr().err
