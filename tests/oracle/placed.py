"""The exhaustive stock-space oracle on damaged clusters: every uniform layout, every place for its slow GPUs.

Written from the wire contract alone, like `enumerator.py`, whose uniform layouts it reuses: for each
layout it spells every replica out (`layout.replicas`, each stage's devices named) and asks
`/v1/estimate`. What it may choose, per API.md: which healthy GPUs form each TP group (one node's GPUs)
and which (replica, stage) each group takes. Its own reductions, from the contract and not from the
planner:

* Full-speed GPUs of a node are interchangeable, and the estimate prices pipeline sends by the job's
  device count, so only where the slow GPUs go matters: for each slow GPU, unused or any cell (replica,
  stage), two slow GPUs of one node possibly in the same cell (one TP group).
* A stock layout is one stock launchers start: in the rank order Megatron-LM, DeepSpeed and torchtitan
  share (tp fastest, then dp, then pp), each node's ranks form one block (`_launch_grid` tries every
  node order and run lengths). Placements no launch order reaches are not stock layouts.
* Layouts whose replicas have the same speed vectors are priced once (replicas are interchangeable).
* Slowing a GPU never speeds a layout up, so a layout whose every GPU at full speed is no faster than the
  best found is skipped (layouts are tried in the order of that all-healthy time).
"""

from __future__ import annotations

import itertools
import random

from api.tasks.planning import estimate_for
from planner.errors import PlanningError
from tests.oracle.enumerator import _layouts, instance
from wire.schemas import EstimateRequest


def damaged_instance(rng: random.Random) -> dict:
    """A small cluster (1-2 nodes of 4 GPUs) with one or two slow GPUs (speeds 0.3-0.9), or one slow
    and one failed, and a 4-9 layer model: small enough that most layouts need every GPU, so where the
    slow ones go decides the plan."""
    body = instance(rng)
    cluster = {**body["cluster"], "gpus_per_node": 4}
    devices = [f"{node}:{gpu}" for node in range(cluster["num_nodes"]) for gpu in range(4)]
    picked = rng.sample(devices, rng.choice([1, 2, 2]))
    failed = picked[1:] if len(picked) == 2 and rng.random() < 0.2 else []
    slow = [{"device": device, "speed": round(rng.uniform(0.3, 0.9), 2)} for device in picked if device not in failed]
    # A replica-by-replica layout names one TP group per stage (API.md): context parallelism is left out of
    # these instances (max_context_parallel 1), and checked on healthy clusters by `enumerator.py`.
    return {**body, "cluster": cluster, "model": {**body["model"], "num_layers": rng.randint(4, 9)},
            "failures": {"failed": failed, "slow": slow},
            "options": {**body["options"], "max_context_parallel": 1}}


def _healthy_devices(body: dict) -> dict[int, list[tuple[int, float]]]:
    """Per node, its GPUs that did not fail, with their speeds."""
    cluster, failures = body["cluster"], body.get("failures", {})
    failed = set(failures.get("failed", []))
    speed = {item["device"]: item["speed"] for item in failures.get("slow", [])}
    return {node: [(gpu, speed.get(f"{node}:{gpu}", 1.0)) for gpu in range(cluster["gpus_per_node"])
                   if f"{node}:{gpu}" not in failed]
            for node in range(cluster["num_nodes"])}


def _launch_grid(devices: dict[int, list[tuple[int, float]]], tp: int, pp: int, dp: int,
                 placed: dict[tuple[int, int], tuple[int, int]]) -> list[list[list[str]]] | None:
    """grid[replica][stage] = device names with the slow GPUs `placed` ((node, gpu) -> cell) where it says
    and every other GPU of a group at full speed, such that a launcher can start it: in Megatron-LM's,
    DeepSpeed's and torchtitan's rank order (tp fastest, then dp, then pp) every node owns one run of
    consecutive cells (torchrun numbers ranks node by node). None when no node order and run lengths do.
    Brute force over node orders and run lengths: these clusters have at most two nodes."""
    cells = [(replica, stage) for stage in range(pp) for replica in range(dp)]
    slow_in: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for device, cell in placed.items():
        slow_in.setdefault(cell, []).append(device)
    full = {node: [gpu for gpu, speed in gpus if speed >= 1.0] for node, gpus in devices.items()}
    for order in itertools.permutations(sorted(devices)):
        for lengths in itertools.product(range(len(cells) + 1), repeat=len(order)):
            if sum(lengths) != len(cells):
                continue
            grid = [[None] * pp for _ in range(dp)]
            position, ok = 0, True
            for node, length in zip(order, lengths):
                spare = list(full[node])
                for replica, stage in cells[position:position + length]:
                    members = slow_in.get((replica, stage), [])
                    if any(n != node for n, _ in members) or len(members) > tp or len(spare) < tp - len(members):
                        ok = False
                        break
                    gpus = [gpu for _, gpu in members] + [spare.pop(0) for _ in range(tp - len(members))]
                    grid[replica][stage] = [f"{node}:{gpu}" for gpu in sorted(gpus)]
                position += length
                if not ok:
                    break
            if ok:
                return grid
    return None


def _placements(devices: dict[int, list[tuple[int, float]]], pp: int, dp: int):
    """Every map of the slow GPUs to a cell (replica, stage) or to nothing."""
    slow = [(node, gpu) for node, gpus in sorted(devices.items()) for gpu, speed in gpus if speed < 1.0]
    options = [None, *itertools.product(range(dp), range(pp))]
    for cells in itertools.product(options, repeat=len(slow)):
        yield {device: cell for device, cell in zip(slow, cells) if cell is not None}


def _speed_rows(devices: dict[int, list[tuple[int, float]]], grid: list[list[list[str]]]) -> tuple:
    """The layout's replicas as speed vectors (a stage as fast as its slowest GPU, API.md), as a multiset:
    layouts equal in it are priced alike, replicas being interchangeable in the cost."""
    speed = {f"{node}:{gpu}": s for node, gpus in devices.items() for gpu, s in gpus}
    return tuple(sorted(tuple(min(speed[d] for d in stage) for stage in row) for row in grid))


def _replicas(layout: dict, grid: list[list[list[str]]], layers: int, batch: int) -> list[dict]:
    pp = layout["pp"]
    split = layout.get("layers_per_stage") or [layers // pp] * pp
    bounds = list(itertools.accumulate([0, *split]))
    microbatches = batch // (layout["micro_batch_size"] * layout["dp"])
    return [{"num_microbatches": microbatches,
             "stages": [{"devices": grid[r][s], "layers": [bounds[s], bounds[s + 1]]} for s in range(pp)]}
            for r in range(layout["dp"])]


def _estimate_s(body: dict, layout: dict, grid: list[list[list[str]]]) -> float | None:
    """The layout's estimated time, None when it cannot run (memory, an impossible split)."""
    fields = {key: layout[key] for key in ("micro_batch_size", "schedule", "recompute") if key in layout}
    if "virtual_stages" in layout:
        fields["virtual_stages"] = layout["virtual_stages"]
    replicas = _replicas(layout, grid, body["model"]["num_layers"], body["training"]["global_batch_size"])
    try:
        request = EstimateRequest.model_validate({**body, "layout": {**fields, "replicas": replicas}})
        return estimate_for(request).predicted.iteration_time_s
    except PlanningError:
        return None


def placed_oracle_best(body: dict) -> tuple[float, dict | None]:
    """The least estimated time over every stock layout and every place of its slow GPUs, and the layout."""
    devices = _healthy_devices(body)
    all_fast = {node: [(gpu, 1.0) for gpu, _ in gpus] for node, gpus in devices.items()}
    unslowed = {**body, "failures": {**body.get("failures", {}), "slow": []}}
    healthy_first = []
    for layout in _layouts(body):
        grid = _launch_grid(all_fast, layout["tp"], layout["pp"], layout["dp"], {})
        if grid is None:
            continue
        time_s = _estimate_s(unslowed, layout, grid)  # every used GPU at full speed: below any placement
        if time_s is not None:
            healthy_first.append((time_s, len(healthy_first), layout))
    healthy_first.sort(key=lambda item: item[:2])
    best: tuple[float, dict | None] = (float("inf"), None)
    for floor_s, _, layout in healthy_first:
        if floor_s >= best[0]:
            break
        priced: set[tuple] = set()
        for placed in _placements(devices, layout["pp"], layout["dp"]):
            grid = _launch_grid(devices, layout["tp"], layout["pp"], layout["dp"], placed)
            if grid is None or _speed_rows(devices, grid) in priced:
                continue
            priced.add(_speed_rows(devices, grid))
            time_s = _estimate_s(body, layout, grid)
            if time_s is not None and time_s < best[0]:
                best = (time_s, {**layout, "grid": grid})
    return best
