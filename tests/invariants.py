"""API.md's seven plan invariants, checked independently of the planner's code.

The compute floor (invariant 7) is recomputed here from the published
formula's ingredients, not taken from cost_models.flops.
"""

from __future__ import annotations

from cost_models.hardware import GpuSpec
from cost_models.model_spec import ModelSpec
from wire.schemas import EstimateRequest, Plan, PlanRequest

# README, "Memory reserve": what a plan leaves free per GPU when the request does not say.
DOCUMENTED_MEMORY_RESERVE_GIB = 3.0


def expand_failed(request: PlanRequest) -> set[str]:
    gpus = request.cluster.gpus_per_node
    out: set[str] = set()
    for text in request.failures.failed:
        node, gpu = text.split(":")
        if gpu == "*":
            out.update(f"{node}:{g}" for g in range(gpus))
        else:
            out.add(f"{int(node)}:{int(gpu)}")
    return out


def independent_model_flops(model: ModelSpec, seq: int, batch: int) -> float:
    """3 x forward: per layer 2 s h (h + 2 kv) + 2 s h h + (3 or 2) 2 s h f + 4 s^2 h; head 2 s h V."""
    h, f, kv = model.hidden_size, model.ffn_hidden_size, model.num_kv_heads * (model.hidden_size // model.num_attention_heads)
    per_layer = 2 * seq * h * (h + 2 * kv) + 2 * seq * h * h + (6 if model.swiglu else 4) * seq * h * f + 4 * seq * seq * h
    return 3.0 * batch * (model.num_layers * per_layer + 2 * seq * h * model.vocab_size)


def check_invariants(plan: Plan, request: PlanRequest, model: ModelSpec, gpu: GpuSpec, speeds: dict[str, float]) -> None:
    """Raise AssertionError naming the first violated invariant."""
    cluster = request.cluster
    all_devices = {f"{n}:{g}" for n in range(cluster.num_nodes) for g in range(cluster.gpus_per_node)}
    failed = expand_failed(request)
    assert plan.replicas, "plan has no replicas"

    # 1. Each replica's stages cover [0, L) contiguously, in order.
    for replica in plan.replicas:
        cursor = 0
        for index, stage in enumerate(replica.stages):
            assert stage.id == index, f"replica {replica.id}: stage ids out of order"
            first, last = stage.layers
            assert first == cursor and last > first, f"replica {replica.id} stage {stage.id}: layers {stage.layers} not contiguous from {cursor}"
            cursor = last
        assert cursor == model.num_layers, f"replica {replica.id} covers {cursor} of {model.num_layers} layers"

    # 2. tp x cp == len(devices); one node, or (context parallelism) whole nodes, each TP group of tp consecutive
    # devices inside one node; tp divides the heads; cp cuts the sequence into 2 cp equal chunks.
    for replica in plan.replicas:
        for stage in replica.stages:
            assert stage.tp * stage.cp == len(stage.devices), f"stage tp {stage.tp} x cp {stage.cp} != {len(stage.devices)} devices"
            nodes = [d.split(":")[0] for d in stage.devices]
            if len(set(nodes)) > 1:
                assert stage.cp > 1, f"stage without context parallelism spans nodes {set(nodes)}"
                assert all(nodes.count(n) == cluster.gpus_per_node for n in set(nodes)), f"stage takes part of a node: {nodes}"
            for rank in range(stage.cp):
                group = nodes[rank * stage.tp:(rank + 1) * stage.tp]
                assert len(set(group)) == 1, f"TP group of CP rank {rank} spans nodes {set(group)}"
            if stage.cp > 1:
                assert request.training.seq_length % (2 * stage.cp * stage.tp) == 0, f"cp {stage.cp} does not cut the sequence evenly"
            assert model.num_attention_heads % stage.tp == 0, f"tp {stage.tp} does not divide {model.num_attention_heads} heads"

    # 3. Partition of the cluster: stages, unused, excluded; failed never used.
    used = [d for r in plan.replicas for s in r.stages for d in s.devices]
    assert len(used) == len(set(used)), "a device appears in two stages"
    assert not (set(used) & failed), f"failed devices used: {sorted(set(used) & failed)}"
    assert set(plan.excluded_devices) == failed, "excluded_devices must be exactly the failed devices"
    unused = set(plan.unused_devices)
    assert len(unused) == len(plan.unused_devices), "unused_devices has duplicates"
    assert not (unused & set(used)) and not (unused & failed), "unused overlaps used or failed"
    assert set(used) | unused | failed == all_devices, "some device is in none of stage / unused / excluded"

    # 4. Microbatches times micro-batch size is the global batch.
    total = sum(r.num_microbatches for r in plan.replicas) * plan.micro_batch_size
    assert total == request.training.global_batch_size, f"{total} sequences != global_batch_size"

    # 5. Memory fits the GPU less the reserve (the request's, else the documented default).
    reserve_gib = request.options.memory_reserve_gib
    reserve_gib = DOCUMENTED_MEMORY_RESERVE_GIB if reserve_gib is None else reserve_gib
    if plan.memory_reserve_gib is not None:
        assert plan.memory_reserve_gib == reserve_gib, f"plan reserves {plan.memory_reserve_gib} GiB, asked {reserve_gib}"
    for replica in plan.replicas:
        for stage in replica.stages:
            assert 0 < stage.memory_gib <= gpu.memory_gib - reserve_gib + 1e-9, (
                f"stage needs {stage.memory_gib} GiB > {gpu.memory_gib} less the {reserve_gib} GiB reserve")

    # 6. uniform flag is exact.
    def signature(replica):
        return (len(replica.stages), tuple((s.tp, s.cp) for s in replica.stages), tuple(tuple(s.layers) for s in replica.stages), replica.num_microbatches)

    is_uniform = len({signature(r) for r in plan.replicas}) == 1
    assert plan.uniform == is_uniform, f"uniform={plan.uniform} but replicas {'are' if is_uniform else 'are not'} identical"

    # 7. Never faster than the compute floor of the devices used (at the FP8 peak for FP8 training: no FLOP
    # runs faster than that).
    flops = independent_model_flops(model, request.training.seq_length, request.training.global_batch_size)
    per_gpu_tflops = gpu.peak_fp8_tflops if request.training.precision == "fp8" else gpu.peak_tflops
    assert per_gpu_tflops is not None, "an fp8 plan on a GPU without FP8 tensor cores"
    peak = sum(per_gpu_tflops * 1e12 * speeds.get(d, 1.0) for d in used)
    floor_s = flops / peak
    assert plan.predicted.iteration_time_s >= floor_s * (1 - 1e-9), f"iteration {plan.predicted.iteration_time_s} s below floor {floor_s} s"

    # 8. The solver report is in the number the plan reports (issue 16), in both modes: objective =
    # 1000 x predicted, the bound at most that, OPTIMAL exactly when the bound meets it.
    solver, reported_ms = plan.solver, plan.predicted.iteration_time_s * 1e3
    assert abs(solver.objective_ms - reported_ms) <= 5e-3 * reported_ms, f"objective {solver.objective_ms} ms, reported {reported_ms} ms"
    assert solver.bound_ms <= solver.objective_ms + 1e-3, f"bound {solver.bound_ms} above objective {solver.objective_ms}"
    proven = solver.bound_ms >= solver.objective_ms * (1 - 1e-6) - 1e-3
    assert (solver.gap == 0.0) == proven, f"gap {solver.gap} with bound {solver.bound_ms}, objective {solver.objective_ms}"
    if isinstance(request, EstimateRequest):
        # A layout given, nothing searched (issue 21): `fixed`, never a search's status, and no stop reason.
        assert (plan.status, solver.status, solver.stopped_by) == ("fixed", "FIXED", None), (plan.status, solver.status)
        assert proven, "an estimate's bound is its own time"
    else:
        assert (solver.status == "OPTIMAL") == proven == (plan.status == "optimal"), f"status {solver.status} with bound {solver.bound_ms}, objective {solver.objective_ms}"

    check_schedule(plan, gpu)


def _op_parts(label: str) -> tuple[str, int, int]:
    kind, rest = label[0], label[1:]
    microbatch, _, chunk = rest.partition(".")
    return kind, int(microbatch), int(chunk or 0)


def check_schedule(plan: Plan, gpu: GpuSpec, tolerance_ms: float = 2e-3) -> None:
    """The returned timelines are runnable and agree with the plan's own numbers.

    Checked from the wire alone: every replica has one timeline; every
    (microbatch, chunk) runs F and B (or I and W) once per stage; each op
    lasts what the stage's times say (1/v of them, or, where a stage's
    `chunk_layers` are uneven, one duration per chunk and kind that add up
    to them); ops of one stage never overlap; an op
    starts only after what it consumes (the previous virtual stage's F, the
    next one's B/I, its own F, its own I); memory_gib is static memory plus
    the activations alive at the timeline's peak; the iteration contains the
    slowest pipeline.
    """
    schedule = plan.pipeline_schedule
    assert schedule is not None, "plan has no pipeline_schedule"
    covered = sorted(i for entry in schedule.replicas for i in entry.replica_ids)
    assert covered == sorted(r.id for r in plan.replicas), "pipeline_schedule does not cover each replica once"
    v = plan.virtual_stages
    by_id = {r.id: r for r in plan.replicas}
    for entry in schedule.replicas:
        replica = by_id[entry.replica_ids[0]]
        p, m = len(replica.stages), replica.num_microbatches
        assert [s.stage for s in entry.stages] == list(range(p)), "timeline stages out of order"
        ends: dict[tuple[str, int, int], float] = {}
        rows = []
        for stage, row in zip(replica.stages, entry.stages):
            assert len(row.ops) == len(row.start_ms) == len(row.end_ms), "ops and times differ in length"
            durations = {
                "F": stage.forward_ms / v, "B": stage.backward_ms / v,
                "I": (stage.backward_ms - stage.weight_grad_ms) / v, "W": stage.weight_grad_ms / v,
            }
            seen = set()
            previous_end = 0.0
            chunk_durations: dict[tuple[str, int], float] = {}
            for label, start, end in zip(row.ops, row.start_ms, row.end_ms):
                kind, microbatch, chunk = _op_parts(label)
                assert (kind, microbatch, chunk) not in seen, f"stage {stage.id}: {label} twice"
                seen.add((kind, microbatch, chunk))
                assert start >= previous_end - tolerance_ms, f"stage {stage.id}: {label} overlaps the op before"
                if stage.chunk_layers is None:
                    assert abs((end - start) - durations[kind]) <= tolerance_ms, f"stage {stage.id}: {label} lasts {end - start}"
                else:
                    first = chunk_durations.setdefault((kind, chunk), end - start)
                    assert abs((end - start) - first) <= tolerance_ms, f"stage {stage.id}: {label} lasts {end - start}"
                previous_end = end
                virtual = chunk * p + stage.id
                ends[(kind if kind in "FW" else "G", microbatch, virtual)] = end
            for microbatch in range(m):
                for chunk in range(v):
                    assert ("F", microbatch, chunk) in seen, f"stage {stage.id}: no F{microbatch}.{chunk}"
                    full = ("B", microbatch, chunk) in seen
                    split = ("I", microbatch, chunk) in seen and ("W", microbatch, chunk) in seen
                    assert full != split, f"stage {stage.id}: microbatch {microbatch} needs B or I+W"
            if stage.chunk_layers is not None:
                for kind in {kind for kind, _ in chunk_durations}:
                    total = sum(chunk_durations.get((kind, chunk), 0.0) for chunk in range(v))
                    assert abs(total - durations[kind] * v) <= v * tolerance_ms, (
                        f"stage {stage.id}: its chunks' {kind} ops add up to {total}, not {durations[kind] * v}")
            rows.append(row)
        last_virtual = p * v - 1
        for stage, row in zip(replica.stages, rows):
            for label, start in zip(row.ops, row.start_ms):
                kind, microbatch, chunk = _op_parts(label)
                virtual = chunk * p + stage.id
                needs = []
                if kind == "F" and virtual > 0:
                    needs.append(("F", microbatch, virtual - 1))
                if kind in "BI":
                    needs.append(("F", microbatch, virtual))
                    if virtual < last_virtual:
                        needs.append(("G", microbatch, virtual + 1))
                if kind == "W":
                    needs.append(("G", microbatch, virtual))
                for need in needs:
                    assert start >= ends[need] - tolerance_ms, f"stage {stage.id}: {label} starts before {need} ends"
        makespan = max(row.end_ms[-1] for row in rows)
        assert abs(makespan - entry.makespan_ms) <= tolerance_ms, "makespan_ms is not the last op's end"
        assert plan.predicted.iteration_time_s * 1e3 >= makespan - tolerance_ms, "iteration shorter than its pipeline"
        busiest = max(row.busy_ms for row in rows)
        assert abs(entry.bubble_fraction - (1 - busiest / makespan)) <= 1e-3, "bubble_fraction disagrees"
        for stage, row in zip(replica.stages, rows):
            alive, peak = 0.0, 0.0
            # A chunk's activations: its share of the stage's layers.
            shares = ([count / sum(stage.chunk_layers) for count in stage.chunk_layers]
                      if stage.chunk_layers is not None else [1 / v] * v)
            for label in row.ops:
                kind, _, chunk = _op_parts(label)
                if kind == "F":
                    alive += stage.activation_gib * shares[chunk]
                    peak = max(peak, alive)
                elif kind in "BW":
                    alive -= stage.activation_gib * shares[chunk]
            expected = stage.static_memory_gib + peak
            assert abs(stage.memory_gib - expected) <= 2e-3 + 1e-3 * expected, (
                f"stage {stage.id}: memory_gib {stage.memory_gib} != static {stage.static_memory_gib} + peak {peak}"
            )
    slowest = max(schedule.replicas, key=lambda entry: entry.makespan_ms)
    assert schedule.name == slowest.schedule == plan.schedule, "schedule names disagree"
