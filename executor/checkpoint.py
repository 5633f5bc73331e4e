"""Per-rank sharded checkpoints, readable into any plan of the same model (`--checkpoint-every`, `--resume`).

Layout: `DIR/step-<NNNNNN>/<node>_<gpu>.pt`, one file per device of the plan that wrote it: its
weight slices and Adam moments as they lie on the device, with the intervals they cover
(`shards.py`), so a reader needs no knowledge of the writer's plan. `complete.json` is written
last, after every rank has saved: a step directory without it is ignored. Resuming on a plan, each
rank NaN-fills its new state, copies from every file the overlap of what that device held with what
it needs (`migrate.copy_overlap`, the same rule as a live move), re-assembles its norms and checks
that nothing is missing; training then goes on at the saved step.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from executor.migrate import HeldState, blank, complete, copy_overlap, held_state
from executor.optimizer import AdamState, Moments
from executor.runtime import Runtime

COMPLETE = "complete.json"


def _file_name(device: str) -> str:
    return device.replace(":", "_") + ".pt"


def save(directory: str | Path, runtime: Runtime, adam: AdamState | None, next_step: int) -> float:
    """Every rank of the world calls it after a step; returns this rank's seconds."""
    began = time.perf_counter()
    step_dir = Path(directory) / f"step-{next_step:06d}"
    if runtime.active:
        step_dir.mkdir(parents=True, exist_ok=True)
        state = held_state(runtime, adam.moments if adam is not None else None)
        torch.save({
            "device": runtime.device,
            "plan_id": runtime.plan.plan_id,
            "params": {name: t.detach().clone() for name, t in state.params.items()},
            "moments": None if state.moments is None else {
                name: (m.exp_avg.clone(), m.exp_avg_sq.clone()) for name, m in state.moments.items()},
            "weights": {unit: [str(lo), str(hi)] for unit, (lo, hi) in state.weights.items()},
            "optimizer": {unit: [[str(lo), str(hi)] for lo, hi in parts] for unit, parts in state.optimizer.items()},
            "full_sizes": state.full_sizes,
        }, step_dir / _file_name(runtime.device))
    dist.barrier()
    if dist.get_rank() == 0:
        (step_dir / COMPLETE).write_text(json.dumps({"next_step": next_step, "plan_id": runtime.plan.plan_id,
                                                     "optimizer": "adam" if adam is not None else "sgd"}))
    dist.barrier()
    return time.perf_counter() - began


def latest(directory: str | Path) -> tuple[Path, dict[str, Any]]:
    """The newest complete checkpoint under `directory` (or `directory` itself if it is one)."""
    root = Path(directory)
    candidates = [root] if (root / COMPLETE).exists() else sorted(root.glob("step-*"), reverse=True)
    for step_dir in candidates:
        if (step_dir / COMPLETE).exists():
            return step_dir, json.loads((step_dir / COMPLETE).read_text())
    raise ValueError(f"no complete checkpoint in {directory} (a step-* directory with {COMPLETE})")


def _interval(pair: list[str]):
    from fractions import Fraction

    return Fraction(pair[0]), Fraction(pair[1])


def _held(saved: dict[str, Any]) -> HeldState:
    moments = None if saved["moments"] is None else {
        name: Moments(avg, sq) for name, (avg, sq) in saved["moments"].items()}
    return HeldState(saved["params"], moments, {unit: _interval(p) for unit, p in saved["weights"].items()},
                     {unit: tuple(_interval(p) for p in parts) for unit, parts in saved["optimizer"].items()},
                     saved["full_sizes"])


def load(step_dir: Path, runtime: Runtime, adam: AdamState | None, num_layers: int) -> float:
    """Fill `runtime`'s state from the checkpoint (every rank of the world calls it); this rank's seconds."""
    began = time.perf_counter()
    moments = blank(runtime, adam)
    if runtime.active:
        for path in sorted(step_dir.glob("*.pt")):
            copy_overlap(_held(torch.load(path)), runtime, moments, num_layers)
    complete(runtime, moments, adam, num_layers, f"resuming from {step_dir}")
    return time.perf_counter() - began
