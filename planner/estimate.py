"""One fixed layout, no search: "how fast is the configuration I run today?"."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from cost_models.choices import Recompute
from cost_models.hardware import GIB
from cost_models.expert_parallel import expert_layout_problem
from cost_models.layout import ParallelShape
from cost_models.iteration import chunk_work_ms
from cost_models.stage_costs import StageCostTerms, stage_cost_terms, stage_memory_bytes
from planner.assemble import assemble_plan, place_slots
from planner.budget import Budget
from cost_models.context_parallel import load_balanced_chunks
from planner.devices import nodes_per_group, slot_inventory
from planner.errors import InfeasibleError, PlanningError
from planner.problem import PlanningProblem
from planner.estimate_replicas import FixedReplica, FixedStage, ReplicaLayout, estimate_replicas
from planner.reported import as_fixed_layout, refuse_overflow
from planner.result import PlanResult
from planner.schedules.for_plan import with_schedules
from planner.schedules.handcrafted import CHUNKED_NAMES
from planner.schedules.ops import ChunkShare
from planner.uniform.candidates import Candidate
from planner.uniform.search import SearchResult, evaluate


@dataclass(frozen=True)
class FixedLayout:
    """A layout as a user states it. dp None: as many replicas as the healthy devices hold."""

    tp: int
    pp: int
    micro_batch_size: int = 1
    virtual_stages: int = 1
    schedule: str = "1f1b"
    recompute: str = Recompute.SELECTIVE
    layers_per_stage: tuple[int, ...] | None = None
    dp: int | None = None
    cp: int = 1
    ep: int = 1
    dp_shard: int | None = None  # replicas of a ZeRO shard group; None: all of them
    etp: int | None = None  # expert tensor parallelism; None: tp
    # Layers of each model chunk, chunk c of stage s at c * pp + s (Megatron's --pipeline-model-parallel-layout
    # order); None: each stage's layers cut into virtual_stages equal chunks.
    layers_per_chunk: tuple[int, ...] | None = None

    @property
    def group_size(self) -> int:
        """GPUs of one stage."""
        return self.tp * self.cp

    def shape_dp_shard(self, dp: int, zero_stage: int) -> int | None:
        """`ParallelShape.dp_shard`: None unless some replicas hold the same shards (hybrid sharding)."""
        return self.dp_shard if zero_stage >= 1 and self.dp_shard is not None and self.dp_shard < dp else None


def _check_layout(problem: PlanningProblem, layout: FixedLayout
                  ) -> tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...] | None]:
    """(dp, layer split, microbatch counts, uneven chunk layers or None), or PlanningError saying what is
    wrong."""
    model = problem.workload.model
    cluster = problem.cluster
    layers = model.num_layers
    if layout.tp > cluster.gpus_per_node:
        raise PlanningError(f"tp {layout.tp} exceeds gpus_per_node {cluster.gpus_per_node}: a TP group must fit in one node")
    if model.num_attention_heads % layout.tp or model.num_kv_heads % layout.tp:
        raise PlanningError(
            f"tp {layout.tp} must divide the {model.num_attention_heads} attention heads and {model.num_kv_heads} KV heads"
        )
    _check_context_parallel(problem, layout)
    chunked = layout.schedule in CHUNKED_NAMES
    if not chunked and layout.virtual_stages != 1:
        raise PlanningError(f"schedule {layout.schedule} runs one model chunk per stage: set virtual_stages to 1 or "
                            f"use {' or '.join(CHUNKED_NAMES)}")
    if chunked and (layout.virtual_stages < 2 or layout.pp < 2):
        raise PlanningError(f"the {layout.schedule} schedule needs pp >= 2 and virtual_stages >= 2")
    if layout.pp > layers:
        raise PlanningError(f"pp {layout.pp} exceeds the model's {layers} layers")
    chunks = _chunk_split(layout, layers)
    if chunks is not None:
        split = tuple(sum(chunks[c * layout.pp + s] for c in range(layout.virtual_stages)) for s in range(layout.pp))
        if layout.layers_per_stage is not None and tuple(layout.layers_per_stage) != split:
            raise PlanningError(f"layers_per_stage {list(layout.layers_per_stage)} disagrees with layers_per_chunk, "
                                f"whose stages hold {list(split)} layers: give one of them")
    elif layout.layers_per_stage is not None:
        split = tuple(layout.layers_per_stage)
        if len(split) != layout.pp or min(split) < 1 or sum(split) != layers:
            raise PlanningError(
                f"layers_per_stage {list(split)} must list pp={layout.pp} positive counts summing to num_layers={layers}"
            )
        if layout.virtual_stages > 1 and len(set(split)) != 1:
            raise PlanningError(f"layers_per_stage {list(split)} with virtual_stages={layout.virtual_stages}: give "
                                "layers_per_chunk to say how each stage's layers split into its model chunks")
    else:
        if layers % layout.pp:
            give = "layers_per_chunk" if layout.virtual_stages > 1 else "layers_per_stage"
            raise PlanningError(f"pp {layout.pp} does not divide num_layers {layers}; give {give} for an uneven split")
        split = (layers // layout.pp,) * layout.pp
    if chunks is None and layout.virtual_stages > 1 and (layers // layout.pp) % layout.virtual_stages:
        raise PlanningError(
            f"{layers // layout.pp} layers per stage cannot be cut into virtual_stages={layout.virtual_stages} equal "
            "chunks; give layers_per_chunk for uneven ones"
        )
    slots = slot_inventory(cluster, layout.group_size).total
    max_dp = slots // layout.pp
    group = f"TP groups of {layout.tp}" if layout.cp == 1 else f"stage groups of tp {layout.tp} x cp {layout.cp}"
    if max_dp < 1:
        raise PlanningError(
            f"tp {layout.tp} x pp {layout.pp} needs {layout.pp} {group} healthy GPUs; the cluster has {slots}"
        )
    dp = layout.dp if layout.dp is not None else max_dp
    if dp > max_dp:
        raise PlanningError(f"dp {dp} needs {dp * layout.pp} {group} healthy GPUs; the cluster has {slots}")
    counts = microbatch_counts(problem, layout, dp, max_dp)
    _check_expert_parallel(problem, layout, dp, counts)
    _check_shard_group(problem, layout, dp, counts)
    if layout.cp > 1 and len(set(counts)) > 1:
        raise PlanningError(f"context parallelism (cp {layout.cp}) is estimated with equal microbatch counts per "
                            f"replica; these replicas would take {_counts_text(counts)}: choose a dp that divides "
                            f"the {sum(counts)} microbatches")
    if layout.schedule in CHUNKED_NAMES and any(count % layout.pp for count in counts):
        raise PlanningError(
            f"the {layout.schedule} schedule needs every replica's microbatches to be a multiple of pp {layout.pp}; "
            f"these replicas take {_counts_text(counts)}"
        )
    if chunks is not None and len(set(counts)) > 1:
        raise PlanningError(f"layers_per_chunk is estimated with equal microbatch counts per replica; these replicas "
                            f"would take {_counts_text(counts)}: choose a dp that divides the {sum(counts)} "
                            "microbatches")
    return dp, split, counts, chunks


def _chunk_split(layout: FixedLayout, layers: int) -> tuple[int, ...] | None:
    """The layout's `layers_per_chunk` checked, or None when it names none or cuts every stage evenly (the
    default cut)."""
    if layout.layers_per_chunk is None:
        return None
    chunks, p, v = tuple(layout.layers_per_chunk), layout.pp, layout.virtual_stages
    if v < 2:
        raise PlanningError("layers_per_chunk gives the layers of interleaved model chunks: set virtual_stages >= 2 "
                            "(and an interleaved schedule), or give layers_per_stage")
    if len(chunks) != p * v or min(chunks) < 1 or sum(chunks) != layers:
        given = f"{list(chunks)}" if len(chunks) <= 64 else f"of {len(chunks)} counts"
        raise PlanningError(f"layers_per_chunk {given} must list pp x virtual_stages = {p} x {v} = {p * v} "
                            f"positive counts (chunk c of stage s at c x pp + s) summing to num_layers={layers}")
    return None if len(set(chunks)) == 1 else chunks


def _check_expert_parallel(problem: PlanningProblem, layout: FixedLayout, dp: int, counts: list[int]) -> None:
    """PlanningError unless the layout's EP groups can exist (`expert_layout_problem`): a mixture of experts,
    ep dividing its routed experts, whole TP groups tiling a replica's CP ranks or whole replicas, and equal
    microbatch counts (replicas sharing experts run in step)."""
    model = problem.workload.model
    if layout.ep == 1 and layout.etp in (None, layout.tp):
        return
    if not model.is_moe:
        raise PlanningError(f"ep {layout.ep}{f', etp {layout.etp}' if layout.etp is not None else ''} needs a "
                            f"mixture-of-experts model; {problem.model_name} is dense")
    problem_text = expert_layout_problem(model, layout.tp, dp, layout.ep, layout.etp, layout.cp)
    if problem_text is not None:
        raise PlanningError(problem_text)
    if len(set(counts)) > 1:
        raise PlanningError(f"expert parallelism (ep {layout.ep}) runs its replicas in step: these replicas would take "
                            f"{_counts_text(counts)} microbatches; choose a dp that divides the {sum(counts)} microbatches")


def _check_shard_group(problem: PlanningProblem, layout: FixedLayout, dp: int, counts: tuple[int, ...]) -> None:
    """PlanningError unless `dp_shard` replicas can form the shard groups: a divisor of dp, something to
    shard (ZeRO >= 1), replicas that run in step (hybrid sharding is priced for equal microbatch counts) and
    EP groups inside shard groups (`ParallelShape.shard_group_holds_ep_groups`)."""
    shard, zero_stage = layout.dp_shard, problem.workload.zero_stage
    if shard is None:
        return
    if zero_stage == 0 and shard != 1:
        raise PlanningError(f"dp_shard {shard} shards nothing with zero_stage 0 (every replica holds all of its "
                            "stage's state): leave dp_shard out, set it to 1, or choose zero_stage 1, 2 or 3")
    if dp % shard:
        raise PlanningError(f"dp_shard {shard} must divide the {dp} replicas: choose one of "
                            f"{', '.join(map(str, _divisors(dp)))}")
    if shard == dp or zero_stage == 0:
        return
    span = max(1, layout.ep * (layout.etp or layout.tp) // layout.tp)  # TP groups of one EP group
    if (shard * layout.cp) % span:
        multiples = [d for d in _divisors(dp) if (d * layout.cp) % span == 0 and d < dp]
        raise PlanningError(
            f"hybrid sharding (dp_shard {shard} of {dp} replicas) with ep {layout.ep}: an EP group spans {span} TP "
            f"groups (ep x etp / tp), which must lie inside one shard group of dp_shard x cp = {shard * layout.cp} "
            "(the experts shard over the shard group's expert ranks): "
            + (f"choose dp_shard {', '.join(map(str, multiples))} or leave it out" if multiples
               else "leave dp_shard out"))
    if len(set(counts)) > 1:
        raise PlanningError(f"hybrid sharding (dp_shard {shard}) is estimated with equal microbatch counts per "
                            f"replica; these replicas would take {_counts_text(counts)}: choose a dp that divides "
                            f"the {sum(counts)} microbatches")


def _check_context_parallel(problem: PlanningProblem, layout: FixedLayout) -> None:
    """PlanningError unless the layout's CP group can exist: flash attention, 2 cp equal sequence chunks,
    and a group inside one node or on whole nodes."""
    if layout.cp == 1:
        return
    seq = problem.workload.seq_length
    window = problem.workload.model.sliding_window
    if window is not None:
        raise PlanningError(f"cp {layout.cp} with sliding-window attention (window {window}) is not modelled: "
                            "resiplan prices a CP ring that exchanges every key and value; plan it with cp 1")
    if not problem.software.flash_attention:
        raise PlanningError(f"cp {layout.cp} needs flash attention (Megatron-Core runs context parallelism through "
                            "Transformer Engine's fused attention only); this request's software has it off")
    if not load_balanced_chunks(seq, layout.cp, layout.tp):
        raise PlanningError(f"cp {layout.cp} cuts each sequence into 2 x cp = {2 * layout.cp} equal chunks, each split "
                            f"over tp {layout.tp}; seq_length {seq} does not divide by {2 * layout.cp * layout.tp}")
    gpus_per_node = problem.cluster.gpus_per_node
    if nodes_per_group(gpus_per_node, layout.group_size) is None or (
            layout.group_size > gpus_per_node and gpus_per_node % layout.tp):
        raise PlanningError(f"tp {layout.tp} x cp {layout.cp} = {layout.group_size} GPUs per stage: a stage group "
                            f"fits in one node or spans whole nodes (a multiple of gpus_per_node {gpus_per_node}, "
                            "with tp dividing a node)")


def microbatch_counts(problem: PlanningProblem, layout: FixedLayout, dp: int, max_dp: int) -> tuple[int, ...]:
    """Each replica's microbatches: the batch split evenly over exactly `dp` replicas (never fewer: the
    estimate is of the layout given), or, where it cannot be and the request allows unequal counts
    (`allow_non_uniform`), as evenly as it goes; else PlanningError with the numbers and the nearest choices
    that work."""
    batch, mbs = problem.workload.global_batch_size, layout.micro_batch_size
    replicas = f"dp {dp}" if layout.dp is not None else f"the {dp} replicas the healthy devices hold (dp omitted)"
    if batch % mbs:
        raise PlanningError(
            f"global_batch_size {batch} is not a multiple of micro_batch_size {mbs}. Choices that work: "
            f"micro_batch_size {_nearest(_divisors(batch), mbs)}, or a global_batch_size of {_nearest_multiples(batch, mbs)}"
        )
    total = batch // mbs
    if total % dp == 0:
        return (total // dp,) * dp
    if total >= dp and not problem.stock_layouts_only:
        # Unequal counts are allowed: the first replicas take one more.
        return tuple(total // dp + (1 if r < total % dp else 0) for r in range(dp))
    dp_choices = [d for d in _divisors(total) if d <= max_dp]
    why = (f"global_batch_size {batch} / micro_batch_size {mbs} = {total} microbatches "
           + (f"cannot give each of {replicas} one" if total < dp else f"do not split evenly over {replicas}"))
    choices = [f"dp {_nearest(dp_choices, dp)}",
               f"a global_batch_size of {_nearest_multiples(batch, dp * mbs)} (multiples of dp {dp} x micro_batch_size {mbs})"]
    sizes = [m for m in _divisors(batch) if (batch // m) % dp == 0]
    if sizes:
        choices.append(f"micro_batch_size {_nearest(sizes, mbs)} with dp {dp}")
    if total >= dp:
        # ZeRO-2/3 layouts are stock ones (planner.zero_choice.with_zero_stage), whatever the option says.
        unequal = ("options.allow_non_uniform: true" if problem.workload.zero_stage <= 1
                   else "zero_stage 0 or 1 with options.allow_non_uniform: true; ZeRO-2 and 3 run equal replicas")
        choices.append(f"unequal microbatch counts per replica ({unequal})")
    raise PlanningError(f"{why}. Choices that work: {'; '.join(choices)}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearest(choices: list[int], to: int, most: int = 3) -> str:
    """Up to `most` of `choices` nearest `to`, ascending, as "a, b or c" ("none" if there are none)."""
    words = [str(c) for c in sorted(sorted(choices, key=lambda c: (abs(c - to), c))[:most])]
    if len(words) <= 1:
        return words[0] if words else "none"
    return ", ".join(words[:-1]) + " or " + words[-1]


def _nearest_multiples(value: int, step: int) -> str:
    """The multiples of `step` on either side of `value`."""
    below, above = value // step * step, -(-value // step) * step
    return " or ".join(str(v) for v in sorted({v for v in (below, above) if v > 0}))


def _counts_text(counts: tuple[int, ...]) -> str:
    """Microbatch counts per replica, as "5 replicas 16, 3 replicas 15"."""
    return ", ".join(f"{counts.count(c)} {'replica' if counts.count(c) == 1 else 'replicas'} {c}"
                     for c in sorted(set(counts), reverse=True))


def estimate_layout(problem: PlanningProblem, layout: FixedLayout) -> PlanResult:
    """The layout's plan, its named schedule simulated."""
    started = time.monotonic()
    dp, split, counts, chunks = _check_layout(problem, layout)
    if len(set(counts)) > 1:
        return _estimate_unequal(problem, layout, split, counts)
    found = _priced(problem, layout, dp, split, started)
    assembled = assemble_plan(problem, found)
    if chunks is not None:
        assembled = _with_chunks(assembled, found.candidate.terms, chunks)
    # The layout names its schedule: simulate exactly that one, no search.
    allowed = frozenset({layout.schedule})
    result = with_schedules(replace(problem, schedules=allowed), assembled, Budget.unlimited(), optional_s=0.0)
    return as_fixed_layout(refuse_overflow(problem, result))


def bubble_model_s(problem: PlanningProblem, layout: FixedLayout | ReplicaLayout) -> float:
    """The layout's iteration time by the bubble model alone: no timeline, no plan assembled (what a
    calibration fit evaluates hundreds of times; a 64-stage timeline of 512 microbatches takes a second)."""
    if isinstance(layout, ReplicaLayout):
        return estimate_replicas(problem, layout, simulate=False).predicted.iteration_time_s
    dp, split, counts, _chunks = _check_layout(problem, layout)
    if len(set(counts)) > 1:
        return _estimate_unequal(problem, layout, split, counts, simulate=False).predicted.iteration_time_s
    return _priced(problem, layout, dp, split, time.monotonic()).objective_ms / 1e3


def _with_chunks(result: PlanResult, terms: StageCostTerms, chunks: tuple[int, ...]) -> PlanResult:
    """`result` with each stage's uneven model chunks: their layer counts, and their shares of the stage's
    forward and backward time (`chunk_work_ms`) and of its activations (by layers), which the schedule's
    timeline runs on."""
    p = terms.shape.pp
    v = len(chunks) // p
    per_stage = []
    for stage in range(p):
        layers = tuple(chunks[c * p + stage] for c in range(v))
        work = chunk_work_ms(terms, stage, layers)
        forward, backward = sum(f for f, _ in work), sum(b for _, b in work)
        shares = tuple(ChunkShare(f / forward, b / backward, n / sum(layers)) for (f, b), n in zip(work, layers))
        per_stage.append((layers, shares))
    replicas = tuple(
        replace(replica, stages=tuple(
            replace(stage, chunk_layers=per_stage[position][0], chunk_shares=per_stage[position][1])
            for position, stage in enumerate(replica.stages)))
        for replica in result.replicas)
    return replace(result, replicas=replicas)


def _priced(problem: PlanningProblem, layout: FixedLayout, dp: int, split: tuple[int, ...],
            started: float) -> SearchResult:
    """The layout (equal microbatch counts) priced by the bubble model, every stage checked to fit."""
    shape = ParallelShape(
        layout.tp, layout.pp, dp, layout.micro_batch_size, layout.recompute, layout.schedule, layout.virtual_stages,
        layout.cp, layout.ep, layout.shape_dp_shard(dp, problem.workload.zero_stage), layout.etp,
    )
    terms = stage_cost_terms(problem.workload, problem.hardware, shape, problem.efficiency, problem.software)
    capacity = problem.usable_memory_bytes
    for stage, count in enumerate(split):
        need = stage_memory_bytes(terms, stage, count)
        if need > capacity:
            raise InfeasibleError(
                f"stage {stage} ({count} layers, tp={layout.tp}{f', cp={layout.cp}' if layout.cp > 1 else ''}, micro_batch_size={layout.micro_batch_size}, "
                f"recompute={layout.recompute}) needs {need / GIB:.1f} GiB per GPU; "
                f"{problem.capacity_text()}"
            )
    candidate = Candidate(terms=terms, inventory=slot_inventory(problem.cluster, layout.group_size), lower_bound_ms=0.0)
    estimate = evaluate(candidate, split)
    return SearchResult(
        candidate=candidate,
        layers_per_stage=split,
        estimate=estimate,
        objective_ms=estimate.iteration_ms,
        bound_ms=estimate.iteration_ms,
        optimal=True,
        wall_time_s=time.monotonic() - started,
        candidates_total=1,
        candidates_solved=0,
    )


def _estimate_unequal(problem: PlanningProblem, layout: FixedLayout, split: tuple[int, ...],
                      counts: tuple[int, ...], simulate: bool = True) -> PlanResult:
    """The layout with unequal microbatch counts: every replica spelled out on the devices the even layout
    would take, priced as any replica-by-replica layout is (`estimate_replicas`), with a note saying who takes
    how many."""
    bounds = [(sum(split[:s]), sum(split[:s + 1])) for s in range(len(split))]
    grid = place_slots(problem, layout.tp, layout.pp, len(counts))
    replicas = tuple(
        FixedReplica(num_microbatches=count,
                     stages=tuple(FixedStage(devices=tuple((slot.node, gpu) for gpu in slot.devices), layers=bounds[s])
                                  for s, slot in enumerate(row)))
        for row, count in zip(grid, counts)
    )
    result = estimate_replicas(problem, ReplicaLayout(replicas, layout.micro_batch_size, layout.virtual_stages,
                                                      layout.schedule, layout.recompute), simulate)
    note = (f"{sum(counts)} microbatches do not split evenly over {len(counts)} replicas: {_counts_text(counts)} "
            "microbatches (unequal counts, allowed by options.allow_non_uniform; stock Megatron-LM, DeepSpeed and "
            "torchtitan need equal ones)")
    return replace(result, solver=replace(result.solver, notes=(*result.solver.notes, note)))
