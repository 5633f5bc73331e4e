"""The user's layout against the best plan: what each difference buys alone (`/v1/compare`, `resiplan compare`).

Each change is one field of the user's layout set to the best plan's (its first replica's, for a non-uniform
plan) and estimated alone, so the gains say which change matters, not how they combine: the best plan's time
is the combination. The user's layout lies in the space the planner searches (any uniform layout with a
stock split, every allowed schedule), so a best plan slower than it is a planner bug: the answer says so
(`planner_slower`) and the service logs it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from api.tasks.importing import import_for
from api.tasks.planning import PlanAnswer, estimate_for, plan_for
from cost_models.sharded_dp import node_shard_replicas
from planner.errors import PlanningError
from wire.calibration import AppliedCalibration
from wire.comparison import CompareResponse
from wire.importing import ImportRequest
from wire.schemas import CompareChange, EstimateRequest, Plan, PlanComparison, PlanRequest

log = logging.getLogger("resiplan.compare")

# Rounding of reported times (1 us) under which the two are equal.
_TIE_S = 2e-6


def _shape(plan: Plan) -> dict:
    """The best plan's layout in `layout` fields, read from its first replica."""
    stages = plan.replicas[0].stages
    split = [stage.layers[1] - stage.layers[0] for stage in stages]
    shape = {"tp": max(stage.tp for stage in stages), "cp": max(stage.cp for stage in stages), "pp": len(stages), "layers_per_stage": split,
             "micro_batch_size": plan.micro_batch_size, "recompute": plan.recompute,
             "schedule": plan.schedule, "virtual_stages": plan.virtual_stages, "ep": plan.ep, "etp": plan.etp,
             "dp_shard": _hybrid_shard(plan)}
    # CP-SAT's order is built for this plan: the best named schedule it was chosen over is one a user can apply.
    named = {name: ms for name, ms in (plan.pipeline_schedule.candidates_ms if plan.pipeline_schedule else {}).items()
             if name != "optimized"}
    shape["named_schedule"] = min(named, key=named.get) if named else None
    return shape


def _hybrid_shard(plan: Plan) -> int | None:
    """The plan's `dp_shard` as a layout states it: None unless shard groups are replicated (hybrid sharding)."""
    shard = plan.dp_shard
    return shard if plan.zero_stage >= 1 and shard is not None and shard < len(plan.replicas) else None


def _searched_shard(plan: Plan, gpus_per_node: int) -> int | None:
    """The hybrid shard group the planner searches for the plan's shape: a node's replicas, under ZeRO-2/3."""
    stage = plan.replicas[0].stages[0]
    return node_shard_replicas(len(plan.replicas), stage.tp * stage.cp, gpus_per_node) if plan.zero_stage >= 2 else None


def _check_searched_shard(yours: Plan, gpus_per_node: int | None) -> None:
    """PlanningError when the user's shard groups lie outside the space the planner searches
    (`planner.uniform.candidates.shard_group_sizes`; `gpus_per_node` None: no hybrid sharding searched): the
    best plan could then be slower than the user's."""
    shard = _hybrid_shard(yours)
    searched = _searched_shard(yours, gpus_per_node) if gpus_per_node is not None else None
    if shard is not None and shard != searched:
        also = f" or {searched}, a node's replicas" if searched is not None else ""
        raise PlanningError(f"dp_shard {shard} (hybrid sharding under zero_stage {yours.zero_stage}) is estimated but "
                            "not searched by the planner, so the best plan would not weigh it: compare with dp_shard "
                            f"left out{also}, or estimate it alone with /v1/estimate")


def _check_searched_expert_tp(yours: Plan) -> None:
    """PlanningError when the user's expert-TP is one the planner does not search (it tries expert-TP = TP and 1,
    `cost_models.expert_parallel.expert_layouts`): the best plan could then be slower than the user's."""
    tp = yours.replicas[0].stages[0].tp
    if yours.etp not in (None, 1, tp):
        raise PlanningError(f"etp {yours.etp} (experts split over {yours.etp} of tp {tp}) is estimated but not searched "
                            "by the planner, which tries etp 1 and etp = tp, so the best plan would not weigh it: compare "
                            "with etp 1 or left out, or estimate it alone with /v1/estimate")


def _split(layout: dict, layers: int) -> list[int]:
    return layout.get("layers_per_stage") or [layers // layout["pp"]] * layout["pp"]


def _candidate_changes(yours: dict, best: dict, layers: int) -> list[tuple[str, dict]]:
    """(description, the user's layout with that one change) for every field the best plan sets otherwise."""
    out = []
    for name in ("micro_batch_size", "recompute"):
        if yours[name] != best[name]:
            out.append((f"{name} {yours[name]} → {best[name]}", {**yours, name: best[name]}))
    if yours["tp"] != best["tp"]:
        out.append((f"tp {yours['tp']} → {best['tp']}", {**yours, "tp": best["tp"], "dp": None}))
    if yours["cp"] != best["cp"]:
        out.append((f"cp {yours['cp']} → {best['cp']}", {**yours, "cp": best["cp"], "dp": None}))
    if yours["etp"] != best["etp"]:  # EP groups depend on both: one change
        def experts(layout: dict) -> str:
            return f"ep {layout['ep']}, etp {'= tp' if layout['etp'] is None else layout['etp']}"
        out.append((f"{experts(yours)} → {experts(best)}", {**yours, "ep": best["ep"], "etp": best["etp"]}))
    elif yours["ep"] != best["ep"]:
        out.append((f"ep {yours['ep']} → {best['ep']}", {**yours, "ep": best["ep"]}))
    if yours["dp_shard"] != best["dp_shard"]:
        def shards(value: int | None) -> str:
            return "all replicas" if value is None else f"{value} replicas"
        out.append((f"dp_shard {shards(yours['dp_shard'])} → {shards(best['dp_shard'])}",
                    {**yours, "dp_shard": best["dp_shard"]}))
    even = len(set(best["layers_per_stage"])) == 1
    split = None if even else best["layers_per_stage"]
    if yours["pp"] != best["pp"]:
        chunked = {"schedule": yours["schedule"], "virtual_stages": yours["virtual_stages"]}
        if yours["virtual_stages"] > 1 and best["pp"] == 1:
            chunked = {"schedule": "1f1b", "virtual_stages": 1}
        out.append((f"pp {yours['pp']} → {best['pp']}" + ("" if even else f" (layers {split})"),
                    {**yours, "pp": best["pp"], "layers_per_stage": split, "dp": None, **chunked}))
    elif _split(yours, layers) != best["layers_per_stage"]:
        out.append((f"layers per stage {_split(yours, layers)} → {best['layers_per_stage']}",
                    {**yours, "layers_per_stage": best["layers_per_stage"]}))
    if (yours["schedule"], yours["virtual_stages"]) != (best["schedule"], best["virtual_stages"]):
        if best["schedule"] == "optimized":
            out.append(("schedule → optimized (CP-SAT)", {}))
            named = best["named_schedule"]
            if named is not None and named != yours["schedule"]:
                v = f" v={best['virtual_stages']}" if named in ("interleaved", "looped-bfs") else ""
                out.append((f"schedule {yours['schedule']} → {named}{v}",
                            {**yours, "schedule": named,
                             "virtual_stages": best["virtual_stages"] if v else 1}))
        else:
            v = f" v={best['virtual_stages']}" if best["virtual_stages"] > 1 else ""
            out.append((f"schedule {yours['schedule']} → {best['schedule']}{v}",
                        {**yours, "schedule": best["schedule"], "virtual_stages": best["virtual_stages"]}))
    return out


def _without_layout_choices(request: EstimateRequest) -> dict:
    """The request without its layout, and without the training fields a layout fixes (micro-batch size,
    recompute), so that neither a changed layout nor the best plan is held to the user's."""
    body = request.model_dump(exclude={"layout"}, exclude_none=True)
    body["training"] = {key: value for key, value in body["training"].items()
                        if key not in ("micro_batch_size", "recompute")}
    return body


def _best_request(request: EstimateRequest) -> PlanRequest:
    """The plan request the best plan answers: the user's, its layout's choices (micro-batch size and recompute
    too) left to the planner."""
    body = _without_layout_choices(request)
    return PlanRequest.model_validate({**body, "training": {**body["training"], "recompute": "auto"}})


def _estimated(request: EstimateRequest, layout: dict, calibration: AppliedCalibration | None) -> Plan:
    fields = {key: value for key, value in layout.items() if value is not None}
    return estimate_for(EstimateRequest.model_validate({**_without_layout_choices(request), "layout": fields}),
                        calibration)


def compare_for(request: EstimateRequest, calibration: AppliedCalibration | None = None) -> CompareResponse:
    """The user's layout (`request.layout`, by shape) against the best plan for the same request."""
    if request.layout.replicas is not None:
        raise PlanningError("compare takes a layout by shape (tp, pp, ...); a replica-by-replica layout is already "
                            "a plan: estimate it with /v1/estimate")
    if request.layout.layers_per_chunk is not None:
        raise PlanningError("layers_per_chunk (uneven model chunks) is estimated but not searched by the planner, so "
                            "the best plan would not weigh it: compare with it left out (each stage's layers cut "
                            "into equal chunks), or estimate it alone with /v1/estimate")
    yours = estimate_for(request, calibration)
    _check_searched_shard(yours, request.cluster.gpus_per_node if request.options.allow_hybrid_sharding else None)
    _check_searched_expert_tp(yours)
    best = plan_for(_best_request(request), calibration=calibration)
    stated = request.layout.model_dump(include={"tp", "cp", "ep", "etp", "pp", "dp", "micro_batch_size", "recompute",
                                                "schedule", "virtual_stages", "layers_per_stage", "dp_shard"})
    stated["etp"] = yours.etp
    stated["dp_shard"] = _hybrid_shard(yours)
    your_s, best_s = yours.predicted.iteration_time_s, best.predicted.iteration_time_s
    changes = []
    for description, layout in _candidate_changes(stated, _shape(best), yours.architecture.num_layers):
        if not layout:
            changes.append(CompareChange(change=description, iteration_time_s=None, gain=None,
                                         why="CP-SAT's schedule is built for the best plan's layout; it is not a "
                                         "named schedule an estimate can apply"))
            continue
        try:
            changed_s = _estimated(request, layout, calibration).predicted.iteration_time_s
        except PlanningError as error:
            changes.append(CompareChange(change=description, iteration_time_s=None, gain=None, why=str(error)))
            continue
        changes.append(CompareChange(change=description, iteration_time_s=changed_s,
                                     gain=round(1 - changed_s / your_s, 6)))
    changes.sort(key=lambda c: (c.gain is None, -(c.gain or 0.0)))
    slower = best_s > your_s + _TIE_S
    if slower:
        log.error("planner slower than the user's layout: best %.6f s, user's %.6f s", best_s, your_s)
    return CompareResponse(yours=yours, best=best, speedup=round(your_s / best_s, 6), changes=changes,
                           planner_slower=slower)


@dataclass(frozen=True)
class ComparisonAnswer:
    """A comparison as a solver worker hands it back: the answer's JSON text, and both plans to store (the
    user's layout carrying the comparison, which its page shows, and the best plan)."""

    response_json: str
    plans: tuple[PlanAnswer, PlanAnswer]


def compare_answer(request: EstimateRequest | ImportRequest,
                   calibration: AppliedCalibration | None = None) -> ComparisonAnswer:
    """compare_for, for a solver worker; an import body is imported first, and what it could not model is
    reported with the comparison."""
    not_modelled: list[str] = []
    if isinstance(request, ImportRequest):
        imported = import_for(request)
        request, not_modelled = EstimateRequest.model_validate(imported.request), imported.not_modelled
    comparison = compare_for(request, calibration)
    best_memory_gib = max(stage.memory_gib for replica in comparison.best.replicas for stage in replica.stages)
    summary = PlanComparison(best_plan_id=comparison.best.plan_id, best=comparison.best.predicted,
                             best_most_memory_gib=best_memory_gib,
                             speedup=comparison.speedup, planner_slower=comparison.planner_slower,
                             changes=comparison.changes)
    yours = comparison.yours.model_copy(update={"comparison": summary})
    response = comparison.model_copy(update={"yours": yours, "not_modelled": not_modelled})
    return ComparisonAnswer(response.model_dump_json(),
                            (PlanAnswer.of(yours, request), PlanAnswer.of(comparison.best, _best_request(request))))
