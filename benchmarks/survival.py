"""Surviving a lost rank, timed: what a SIGKILLed GPU process costs a job that survives it in place, next to
one that restarts on the replan from its last checkpoint.

    python -m benchmarks.survival [--write]

Starts `resiplan serve` (a temporary SQLite store), plans a 12-layer model on 4 x 2 A100-40GB (2 replicas of
TP-2 x 2 stages, interleaved, ZeRO-0) and runs the reference executor on 8 gloo processes (Adam, the model
shrunk for CPU, ranks timed as GPUs with `--emulate-ms-per-layer`, a checkpoint every 4 steps):

- **survive** (`resiplan-launch ... --survive --fail-device 2:1@KILL_STEP`): the survivors notice (on one host,
  the dead process's exit), meet, get the replan, move the lost state from the other replica and redo the step.
  Time lost = the interrupted step's work until the error + the recovery + the redone step's excess over a
  steady step.
- **restart**: what a job does without survival: every process stops, new ones start on the replan and
  resume from the newest checkpoint (written after step KILL_STEP - 1 at best; here the one 4 steps apart
  is older by KILL_STEP mod 4 steps, which are run again). Time lost = the launch, imports, process groups and
  checkpoint reading + the steps run again (the steady step time of the replan) + noticing the loss (not run
  here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.live_loop import _jsonl, _serve

ROOT = Path(__file__).resolve().parent.parent
REQUEST = {
    "cluster": {"num_nodes": 4, "gpus_per_node": 2, "gpu": "A100-40GB"},
    # 8 heads: the executor shrinks the model to hidden 64 and keeps the head count; at 32 heads (head dim 2)
    # Adam amplifies fp32 summation-order noise to 1e-3 of a tensor's scale within 5 steps even in a run that
    # loses nothing, beyond tests/executor/test_survival.py's parameter tolerance; at head dim 8 it stays within
    "model": {"num_layers": 12, "hidden_size": 4096, "ffn_hidden_size": 16384, "num_attention_heads": 8,
              "num_kv_heads": 4, "vocab_size": 32000, "swiglu": True, "tied_embeddings": False},
    # ZeRO-0: every data-parallel replica holds the whole optimizer state, so a lost GPU's share survives
    "training": {"global_batch_size": 32, "seq_length": 4096, "zero_stage": 0},
    "options": {"time_limit_s": 2, "schedules": ["interleaved"]},
}
FAILED = "2:1"
STEPS, KILL_STEP, CHECKPOINT_EVERY = 10, 6, 4
EMULATE_MS_PER_LAYER = 20.0


def _launch(world: int, plan: Path, out: Path, extra: Sequence[str]) -> float:
    command = [sys.executable, "-m", "executor.launch", "--nproc-per-node", str(world), "--log-dir", str(out / "logs"),
               "--plan", str(plan), "--steps", str(STEPS), "--optimizer", "adam", "--lr", "0.001",
               "--emulate-ms-per-layer", str(EMULATE_MS_PER_LAYER), "--timeout", "300", "--out-dir", str(out),
               *extra]
    began = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=1800)
    if done.returncode != 0:
        logs = "".join(p.read_text()[-2000:] for p in sorted((out / "logs").glob("*.log")))
        raise RuntimeError(f"resiplan-launch failed: {done.stderr[-2000:]}{logs}")
    return time.perf_counter() - began


def _steady_s(records: list[dict], first: int, end: int) -> float:
    return statistics.median(r["step_s"] for r in records if first <= r["step"] < end)


def measure(tmp: Path) -> dict:
    from adapters.client import PlannerClient

    process, url = _serve(tmp)
    try:
        with PlannerClient(url) as client:
            plan = client.plan(REQUEST)
            plan_path = tmp / "plan.json"
            plan_path.write_text(plan.model_dump_json())
            world = len({d for r in plan.replicas for s in r.stages for d in s.devices})
            out = tmp / "survive"
            _launch(world, plan_path, out, ["--server", url, "--survive", "--fail-device", f"{FAILED}@{KILL_STEP}"])
            events, records = _jsonl(out / "events.jsonl"), _jsonl(out / "losses.jsonl")
            recovery = next(e for e in events if e["event"] == "recovery")
            survived = {"recovery": recovery, "records": records,
                        "transfers": next(e for e in events if e["event"] == "reconfigure")["transfers"]}
            replanned = client.get(recovery["plan_id"])
        # The restart: checkpoints from a run of the plan up to the failure, then new processes on the replan.
        before = tmp / "before"
        _launch(world, plan_path, before, ["--checkpoint-every", str(CHECKPOINT_EVERY)])
        checkpoint = before / "checkpoints" / f"step-{KILL_STEP // CHECKPOINT_EVERY * CHECKPOINT_EVERY:06d}"
        replan_path = tmp / "replan.json"
        replan_path.write_text(replanned.model_dump_json())
        restart = tmp / "restart"
        restart_wall_s = _launch(world - 1, replan_path, restart, ["--resume", str(checkpoint)])
        restart_records = _jsonl(restart / "losses.jsonl")
    finally:
        process.terminate()
        process.wait(timeout=30)
    return {"plan": plan, "replanned": replanned, "survived": survived, "restart_wall_s": restart_wall_s,
            "restart_records": restart_records,
            "resume_s": next(e["seconds"] for e in _jsonl(restart / "events.jsonl") if e["event"] == "resume")}


def summarize(m: dict) -> dict:
    recovery, records = m["survived"]["recovery"], m["survived"]["records"]
    steady = _steady_s(records, KILL_STEP + 1, STEPS)
    redo_excess = next(r["step_s"] for r in records if r["step"] == KILL_STEP) - steady
    survive = {**{k: recovery[k] for k in ("interrupted_s", "rendezvous_s", "replan_s", "regroup_s", "transfers_s",
                                           "total_s")},
               "steady_before_s": _steady_s(records, 1, KILL_STEP), "steady_after_s": steady,
               "redo_excess_s": redo_excess, "transfers": m["survived"]["transfers"],
               "lost_s": recovery["interrupted_s"] + recovery["total_s"] + max(redo_excess, 0.0)}
    restart = m["restart_records"]
    restart_steady = _steady_s(restart, restart[0]["step"] + 1, STEPS)
    rerun_steps = KILL_STEP - restart[0]["step"]
    overhead_s = m["restart_wall_s"] - sum(r["step_s"] for r in restart)
    return {"survive": survive, "restart": {"overhead_s": overhead_s, "resume_s": m["resume_s"],
                                            "rerun_steps": rerun_steps, "steady_s": restart_steady,
                                            "lost_s": overhead_s + rerun_steps * restart_steady}}


def _shape(plan) -> str:
    """Replicas as [layers x TP per stage] x microbatches."""
    return " + ".join("[" + ", ".join(f"{st.layers[1] - st.layers[0]}L x TP-{st.tp}" for st in r.stages)
                      + f"] x {r.num_microbatches}mb" for r in plan.replicas)


def report(m: dict, s: dict) -> str:
    lines = [f"GPU {FAILED} SIGKILLed in step {KILL_STEP} of {STEPS}: {_shape(m['plan'])} -> the replan "
             f"{_shape(m['replanned'])}. Ranks timed as GPUs ({EMULATE_MS_PER_LAYER:g} ms per layer and sequence).",
             "",
             "| | step before (s) | interrupted step until the error (s) | rendezvous (s) | replan (s) | "
             "regroup (s) | transfers (s) | redone step's excess (s) | time lost (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    row, r = s["survive"], s["restart"]
    lines += [
        f"| survive in place | {row['steady_before_s']:.2f} | {row['interrupted_s']:.2f} | {row['rendezvous_s']:.2f} | "
        f"{row['replan_s']:.2f} | {row['regroup_s']:.2f} | {row['transfers_s']:.2f} ({row['transfers']} transfers) | "
        f"{row['redo_excess_s']:.2f} | **{row['lost_s']:.1f}** |",
        f"| restart on the replan from the checkpoint | - | - | - | - | - | - | - | **{r['lost_s']:.1f}** + noticing |",
        "",
        "- The rendezvous waits until every member has arrived or is gone (on one host: its process has exited, "
        "checked every 0.25 s); the survivors wake within a heartbeat period of the first error.",
        f"- Restart: launch, imports, process groups and reading the checkpoint took {r['overhead_s']:.1f} s "
        f"({r['resume_s']:.2f} s of it reading), plus {r['rerun_steps']} steps run again at "
        f"{r['steady_s']:.2f} s (the checkpoint every {CHECKPOINT_EVERY} steps); noticing the loss costs it a "
        "timeout too.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write BENCHMARKS.md's section")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        m = measure(Path(tmp))
    s = summarize(m)
    text = report(m, s)
    print(text)
    print(json.dumps(s, indent=1))
    if args.write:
        from benchmarks.report import write_section

        write_section("Surviving a lost rank", "python -m benchmarks.survival --write", text)


if __name__ == "__main__":
    main()
