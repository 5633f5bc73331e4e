"""Memory of a solver worker answering one large POST /v1/detect: 4,096 devices x 8 iterations.

    python -m benchmarks.detect_memory           # print the table
    python -m benchmarks.detect_memory --write   # also update BENCHMARKS.md

The body: a 4,096-GPU plan (512 x 8 H100, llama3-70b, tp 8 pp 4 dp 128, micro-batch size 5 at 8,192
tokens, full recompute: 8 packed microbatches per replica and iteration) and 8 iterations of generated
telemetry (`benchmarks/telemetry.py`) from every device, one of them slowed to 0.5: ~60 MiB of JSON,
just under the 64 MiB /v1/detect limit. Each path runs once in a fresh solver worker (`api.core.execution`,
forked from the warm forkserver, no memory limit), which then reports its peak resident memory (VmHWM)
and what it still holds (VmRSS):

- item by item: what the service runs (`api.tasks.detection.detect_json`: each telemetry item validated alone
  and reduced to its totals);
- whole body, for reference: the former path, the whole DetectRequest validated at once into pydantic
  objects, then one TelemetryItem per item, then the same detector.

Both must name the slowed device and nothing else. Linux only (/proc/self/status).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from api.core.execution import PoolConfig, SolverPool
from api.tasks.detection import detect_for, detect_json
from api.tasks.planning import estimate_for
from benchmarks.telemetry import Slowdown, TelemetryConfig, generate_telemetry, to_wire
from detector import Microbatch, TelemetryItem
from wire.convert import resolve_model
from wire.detection import DetectRequest
from wire.schemas import EstimateRequest, Plan

MIB = 1024 * 1024


def worker_memory_mib() -> dict[str, float]:
    """In a worker: its resident memory now (VmRSS) and at its peak (VmHWM), MiB."""
    memory: dict[str, float] = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                memory[key] = int(value.split()[0]) / 1024  # kB
    return memory


def whole_body_detect(body: bytes, plan_json: str) -> list[str]:
    """In a worker: the former /v1/detect path (the whole body as pydantic objects, then TelemetryItems)."""
    request = DetectRequest.model_validate_json(body)
    items = [
        TelemetryItem(
            device=item.device,
            iteration=item.iteration,
            microbatches=tuple(Microbatch(tuple(mb.seq_lengths), mb.compute_ms) for mb in item.microbatches),
            last_heartbeat_s_ago=item.last_heartbeat_s_ago,
        )
        for item in request.telemetry
    ]
    return [finding.device for finding in detect_for(Plan.model_validate_json(plan_json), items).fail_slow]


def item_by_item_detect(body: bytes, plan_json: str) -> list[str]:
    """In a worker: what the service runs."""
    return [finding.device for finding in detect_json(body, plan_json).fail_slow]


@dataclass(frozen=True)
class Measurement:
    path: str
    fresh_mib: float
    peak_mib: float
    after_mib: float
    wall_s: float
    found: list[str]


@dataclass(frozen=True)
class DetectBody:
    body: bytes
    plan_json: str
    slow_device: str
    sequences_per_microbatch: float

    @property
    def mib(self) -> float:
        return len(self.body) / MIB


def large_detect_body() -> DetectBody:
    request = EstimateRequest.model_validate({
        "cluster": {"num_nodes": 512, "gpus_per_node": 8, "gpu": "H100-SXM"},
        "model": "llama3-70b",
        "training": {"global_batch_size": 5 * 1024, "seq_length": 8192},
        "layout": {"tp": 8, "pp": 4, "micro_batch_size": 5, "recompute": "full"},
    })
    plan = estimate_for(request)
    slow = plan.replicas[5].stages[1].devices[3]
    windows = generate_telemetry(plan, resolve_model(plan.architecture),
                                 TelemetryConfig(iterations=8, slowdowns=(Slowdown(slow, 0.5, 0),)))
    telemetry = [item for window in windows for item in to_wire(window)]
    microbatches = [mb for item in telemetry for mb in item["microbatches"]]
    return DetectBody(
        body=json.dumps({"plan_id": plan.plan_id, "telemetry": telemetry}).encode(),
        plan_json=plan.model_dump_json(),
        slow_device=slow,
        sequences_per_microbatch=sum(len(mb["seq_lengths"]) for mb in microbatches) / len(microbatches),
    )


async def measure(path: str, task: Callable[[bytes, str], list[str]], body: bytes, plan_json: str) -> Measurement:
    pool = SolverPool(PoolConfig(workers=1, queue_size=0, grace_s=600))
    await pool.start()
    try:
        fresh = await pool.run(worker_memory_mib, deadline_s=60)
        started = time.perf_counter()
        found = await pool.run(task, body, plan_json, deadline_s=600)
        wall_s = time.perf_counter() - started
        after = await pool.run(worker_memory_mib, deadline_s=60)
    finally:
        await pool.close()
    return Measurement(path, fresh["VmRSS"], after["VmHWM"], after["VmRSS"], wall_s, found)


def run() -> str:
    large = large_detect_body()
    rows = [
        asyncio.run(measure("item by item (the service)", item_by_item_detect, large.body, large.plan_json)),
        asyncio.run(measure("whole body as pydantic objects (former)", whole_body_detect, large.body, large.plan_json)),
    ]
    for row in rows:
        if row.found != [large.slow_device]:
            raise SystemExit(f"{row.path} found {row.found}, expected [{large.slow_device!r}]")
    body_mib = large.mib
    lines = [
        f"Body: {body_mib:.1f} MiB of JSON, 4,096 devices x 8 iterations x 8 packed microbatches of "
        f"{large.sequences_per_microbatch:.0f} sequences on average; one device slowed to 0.5, found by both "
        "paths and nothing else.",
        "",
        "| path | fresh worker | peak | peak / body | still resident after | wall time |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.path} | {row.fresh_mib:.0f} MiB | {row.peak_mib:.0f} MiB | {row.peak_mib / body_mib:.1f}x | "
            f"{row.after_mib:.0f} MiB | {row.wall_s:.1f} s |"
        )
    lines += [
        "",
        "Peak and resident memory of the worker process (VmHWM, VmRSS), including the ~fresh-worker baseline "
        "(interpreter, planner, OR-Tools). A worker still resident in more than "
        "`RESIPLAN_SOLVER_WORKER_MAX_RSS_MIB` (default 512) after a task is replaced.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="write the section into BENCHMARKS.md")
    args = parser.parse_args(argv)
    body = run()
    print(body)
    if args.write:
        from benchmarks.report import write_section

        write_section("Detection memory", "python -m benchmarks.detect_memory", body)


if __name__ == "__main__":
    main()
