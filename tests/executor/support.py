"""Plans and a multi-process gloo world for the executor tests.

Kept free of the planner's imports: spawned ranks import this module to find their entry point.
"""

from __future__ import annotations

import multiprocessing
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from executor import run as executor_run
from wire.schemas import ModelArchitecture, Plan

# What the ranks train: a 4-head (2 KV heads) model small enough for 7 gloo ranks on 2 cores.
TINY = {"hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4, "num_kv_heads": 2, "vocab_size": 64,
        "swiglu": True, "tied_embeddings": False}
SEQ_LENGTH = 16
LR = 1.0  # large enough that a 10% gradient error moves the parameters far beyond the tolerance


def _arch(num_layers: int, hidden: int, heads: int, kv_heads: int) -> dict[str, Any]:
    return {"num_layers": num_layers, "hidden_size": hidden, "ffn_hidden_size": 4 * hidden,
            "num_attention_heads": heads, "num_kv_heads": kv_heads, "vocab_size": 32000, "swiglu": True,
            "tied_embeddings": False}


# The planner sees a real-sized model (so tensor parallelism pays) on a damaged cluster; the executor
# then trains the tiny architecture on exactly that layout.
REQUESTS = {
    # 2 nodes x 4 A100-40GB, GPU 0:3 failed: two identical replicas, stage 0 at tp 1 on node 0 and
    # stage 1 at tp 2 on node 1, zero-bubble schedule (separate I and W ops). Named, and estimated, rather than
    # planned: what the planner prefers here moves with the cost model (since 2026-12-05 a non-uniform plan),
    # and this test exists for a uniform plan whose TP changes along the pipeline.
    "uniform": {
        "cluster": {"num_nodes": 2, "gpus_per_node": 4, "gpu": "A100-40GB"},
        "failures": {"failed": ["0:3"]},
        "model": _arch(8, 4096, 32, 8),
        "training": {"global_batch_size": 8, "seq_length": 4096},
        "options": {"time_limit_s": 2},
        "layout": {"replicas": [{"num_microbatches": 4, "stages": [{"devices": [first], "layers": [0, 3]},
                                                                   {"devices": second, "layers": [3, 8]}]}
                                for first, second in (("0:0", ["1:0", "1:1"]), ("0:1", ["1:2", "1:3"]))],
                   "micro_batch_size": 1, "schedule": "zb-h2"},
    },
    # 4 nodes x 2 A100-40GB, GPU 0:1 failed: replica 0 keeps tp 2 everywhere, replica 1 runs its first
    # stage at tp 1 on the surviving GPU of node 0, with fewer layers there and fewer microbatches.
    # Interleaved only: with every schedule the planner now finds a faster single-replica layout (the
    # stock search beside the bubble-model ones), and this test exists for a non-uniform interleaved run.
    "non-uniform": {
        "cluster": {"num_nodes": 4, "gpus_per_node": 2, "gpu": "A100-40GB"},
        "failures": {"failed": ["0:1"]},
        "model": _arch(12, 4096, 32, 8),
        "training": {"global_batch_size": 32, "seq_length": 4096},
        "options": {"time_limit_s": 2, "schedules": ["interleaved"]},
    },
    # 1 node x 4 GPUs: two interleaved replicas of 2 stages whose model chunks are uneven (layers_per_chunk): the
    # embedding's chunk and the loss's hold 1 layer, the others 3.
    "uneven-chunks": {
        "cluster": {"num_nodes": 1, "gpus_per_node": 4, "gpu": "A100-80GB"},
        "model": _arch(8, 4096, 32, 8),
        "training": {"global_batch_size": 8, "seq_length": 4096},
        "options": {"time_limit_s": 2},
        "layout": {"tp": 1, "pp": 2, "dp": 2, "micro_batch_size": 1, "virtual_stages": 2, "schedule": "interleaved",
                   "recompute": "none", "layers_per_chunk": [1, 3, 3, 1]},
    },
    # 1 node x 2 GPUs, microbatches of one sequence: two single-stage replicas doing the same work, the
    # cleanest peers for timing (and only two busy processes on the 2-core test machine).
    "telemetry": {
        "cluster": {"num_nodes": 1, "gpus_per_node": 2, "gpu": "A100-80GB"},
        "model": {"num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
                  "num_kv_heads": 2, "vocab_size": 128, "swiglu": True, "tied_embeddings": False},
        "training": {"global_batch_size": 16, "seq_length": 128, "micro_batch_size": 1},
        "options": {"time_limit_s": 2},
    },
}


def tiny(plan: Plan) -> Plan:
    """The plan with the tiny architecture (same layer count) and a short sequence (small plans stay as they are)."""
    if plan.architecture.hidden_size <= TINY["hidden_size"] * 2:
        return plan
    arch = ModelArchitecture(num_layers=plan.architecture.num_layers, name="tiny", **TINY)
    return plan.model_copy(update={"architecture": arch, "seq_length": SEQ_LENGTH})


def used_devices(plan: Plan) -> int:
    return sum(len(stage.devices) for replica in plan.replicas for stage in replica.stages)


# ---------------------------------------------------------------------------------------------------------------
# One world of processes runs several plans in turn; rank 0 is the calling (test) process.


@dataclass
class Case:
    name: str
    plan_json: str
    options: executor_run.Options
    out_dir: str
    telemetry: str | None = None
    reconfigure: tuple[tuple[int, str], ...] = ()  # (step, plan JSON): switch to that plan at that step


def _worker(rank: int, world: int, store: str, cases: list[Case]) -> None:
    for case in cases:
        executor_run.run_rank(rank, world, f"file://{store}-{case.name}", case.plan_json, case.options,
                                out_dir=case.out_dir, telemetry_path=case.telemetry, timeout_s=60.0,
                                reconfigure=list(case.reconfigure))


def _child(index: int, world: int, store: str, cases: list[Case]) -> None:
    try:
        _worker(index + 1, world, store, cases)
    except BaseException:
        traceback.print_exc()  # the parent may be blocked in a collective; show why before it times out
        raise


# Imported once in the fork server rather than in every rank: torch, and what DTensor and the pipelining
# runtime import lazily on first use (dynamo and its sympy, ~900 modules).
PRELOAD = ["torch", "torch._dynamo", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
           "torch.distributed.pipelining", "torch.distributed.fsdp", "executor.run"]


def run_world(cases: list[Case], world: int, tmp_path: Path, seconds: float = 120.0) -> None:
    """Run every case on `world` gloo ranks: this process and world - 1 forked from a torch-preloaded server."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    store = str(tmp_path / "store")
    children = mp.start_processes(_child, args=(world, store, cases), nprocs=world - 1, join=False,
                                  start_method="forkserver")
    try:
        try:
            _worker(0, world, store, cases)
        except BaseException:
            _join(children, 10)  # a child's failure is usually the cause: raise that one if there is one
            raise
        assert _join(children, seconds), f"ranks 1..{world - 1} did not finish within {seconds} s"
    finally:
        for process in children.processes:
            if process.is_alive():
                process.terminate()


def _join(context, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not context.join(timeout=0.5):
        if time.monotonic() > deadline:
            return False
    return True


# ---------------------------------------------------------------------------------------------------------------
# Results


def replica_states(out_dir: str | Path) -> dict[int, dict[str, torch.Tensor]]:
    """Full final parameters per plan replica, assembled from its leaders' files."""
    states: dict[int, dict[str, torch.Tensor]] = {}
    for path in sorted(Path(out_dir).glob("rank*.pt")):
        saved = torch.load(path)
        if saved["replica"] is not None:
            states.setdefault(saved["replica"], {}).update(saved["params"])
    return states


def losses(out_dir: str | Path) -> list[float]:
    return torch.load(Path(out_dir) / "rank0.pt")["losses"]


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """max |got - expected| / max |expected|: fp32 summation-order noise is ~1e-7..1e-6 of the tensor's scale."""
    return ((got - expected).abs().max() / expected.abs().max()).item()


def mismatches(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], tolerance: float) -> list[str]:
    if set(state) != set(reference):
        return [(f"parameters differ: missing {sorted(set(reference) - set(state))}, "
                 f"extra {sorted(set(state) - set(reference))}")]
    return [f"{name}: relative error {relative_error(state[name], reference[name]):.2e}"
            for name in reference if relative_error(state[name], reference[name]) > tolerance]
