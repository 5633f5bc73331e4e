"""POST /v1/calibrations: measured runs in, the cost model's efficiency parameters fitted to them out."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cost_models.efficiency import CALIBRATION_BOUNDS, EfficiencyParams
from planner.calibration_span import UNSHARDED, CalibrationSpan, extrapolations, shard_reach
from planner.problem import PlanningProblem
from wire.schemas import EstimateRequest, Plan

MAX_CALIBRATION_RUNS = 32
MAX_MEASURED_PLANS = 8
MAX_ROLES_PER_PLAN = 256


class MeasuredRunRequest(EstimateRequest):
    """A `/v1/estimate` request plus the iteration time measured for that layout on the user's cluster."""

    measured_iteration_time_s: float = Field(gt=0, le=1e6, description="Seconds per training iteration, measured.")


class MeasuredRole(BaseModel):
    """A role's time model as `/v1/detect` answers it (`time_models[i]`): the compute one of its GPUs spends
    per microbatch, alpha x tokens + beta x the summed squared sequence lengths."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    layers: tuple[int, int] = Field(description="[first, end) of the role's stages.")
    tp: int = Field(ge=1, le=1024)
    devices: int = Field(default=1, ge=1)
    alpha_ms_per_token: float | None = Field(default=None, ge=0, le=1e6)
    beta_ms_per_token_squared: float | None = Field(default=None, ge=0, le=1e6)
    attention_factor: float | None = Field(default=None, ge=0)
    source: str | None = Field(default=None, max_length=16)


class MeasuredPlan(BaseModel):
    """The roles `/v1/detect` measured on a job running a stored plan: pass its `time_models` as answered."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    plan_id: str = Field(min_length=1, max_length=64)
    time_models: list[MeasuredRole] = Field(min_length=1, max_length=MAX_ROLES_PER_PLAN)


class CalibrationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9 ._:/+-]+$",
                      description="What the runs measured: a cluster, a software stack.")
    runs: list[MeasuredRunRequest] = Field(default_factory=list, max_length=MAX_CALIBRATION_RUNS)
    roles: list[MeasuredPlan] = Field(
        default_factory=list, max_length=MAX_MEASURED_PLANS,
        description="Per-role compute measured by `/v1/detect` on jobs running stored plans; each role with an "
        "alpha counts as one run, priced as the cost model's compute of one microbatch of the plan on one of its "
        "GPUs (no TP, CP or EP traffic).")

    @model_validator(mode="after")
    def _something_measured(self) -> CalibrationRequest:
        if not self.runs and not any(role.alpha_ms_per_token is not None
                                     for plan in self.roles for role in plan.time_models):
            raise ValueError("nothing to fit: give runs (estimate requests with measured_iteration_time_s), or roles "
                             "whose time models /v1/detect measured (alpha_ms_per_token)")
        return self


class CalibratedRun(BaseModel):
    source: str | None = Field(default=None, description="`runs[i]`, or `roles[i].time_models[j]`: a role's compute "
                               "per microbatch.")
    measured_s: float
    predicted_s: float = Field(description="`/v1/estimate`'s prediction with the fitted parameters.")
    error: float = Field(description="predicted_s / measured_s - 1.")
    cross_validated_predicted_s: float | None = Field(
        default=None, description="The prediction of a fit to the other runs (leave-one-out); null with one run.")
    cross_validated_error: float | None = None


class CalibrationRefit(BaseModel):
    """What a refit replaced: the fit made under an earlier cost model."""

    reason: str = Field(description="Why the runs were refitted, with the largest change in a run's prediction.")
    previous_parameters: dict[str, float]
    previous_fit_mape: float


class CalibrationCoverage(BaseModel):
    """What the calibrated runs span (`planner.calibration_span`): a plan priced with the calibration outside it
    names how in `predicted.calibration_extrapolates`."""

    gpus: list[str]
    nvlink_topologies: list[str] | None = Field(
        default=None, description="How the runs' nodes linked their GPUs (cluster.nvlink_topology). Null in a "
        "coverage stored before this field: the service fills it in the next time it reads the calibration.")
    precisions: list[str]
    tp: tuple[int, int] = Field(description="Least and most TP degree of the runs' stages.")
    cp: tuple[int, int]
    ep: tuple[int, int]
    model_parameters: tuple[int, int] = Field(description="Least and most parameters of the runs' models.")
    microbatch_tokens: tuple[int, int] = Field(description="Least and most tokens in one microbatch.")
    zero_sharding: list[str] | None = Field(
        default=None, description="Where the runs' ZeRO-2/3 per-layer collectives ran (what a fitted "
        "shard_overlap_fraction was measured over): \"none\" (ZeRO-0/1, or nothing sharded), \"within a node\", "
        "\"across nodes\". Null in a coverage stored before this field: the service fills it in the next time it "
        "reads the calibration.")

    @classmethod
    def of(cls, span: CalibrationSpan) -> CalibrationCoverage:
        return cls(gpus=sorted(span.gpus), nvlink_topologies=sorted(span.nvlink_topologies),
                   precisions=sorted(span.precisions), tp=span.tp, cp=span.cp, ep=span.ep,
                   model_parameters=span.parameters, microbatch_tokens=span.microbatch_tokens,
                   zero_sharding=sorted(span.shard_reaches))

    def span(self) -> CalibrationSpan:
        # Null only until the service next reads the stored calibration and fills it in: the defaults meanwhile.
        return CalibrationSpan(frozenset(self.gpus), frozenset(self.nvlink_topologies or ["switch"]),
                               frozenset(self.precisions), self.tp, self.cp, self.ep,
                               self.model_parameters, self.microbatch_tokens,
                               frozenset(self.zero_sharding or [UNSHARDED]))


class Calibration(BaseModel):
    calibration_id: str
    name: str
    parameters: dict[str, float] = Field(description="Fitted efficiency parameters (README, \"The cost model\").")
    default_parameters: dict[str, float] = Field(description="The built-in parameters the fit started from.")
    fitted: list[str] = Field(description="Parameters the runs determined: `parameters` move them `fit_weight` of "
                              "the way to their best fit (0: not at all).")
    unidentified: list[str] = Field(description="Parameters the runs cannot tell apart from the fitted ones: kept "
                                    "at their built-in values. More runs that differ in model size, TP, PP or "
                                    "scale identify more.")
    at_bound: list[str] = Field(description="Fitted parameters whose best fit stopped at the edge of their physical "
                                "range (`parameters`, shrunk by `fit_weight`, sit just inside it): the "
                                "runs ask for more than the parameter can mean, so the model misses an effect "
                                "of this stack. shard_overlap_fraction at 1 (every per-layer collective hidden) is "
                                "the frameworks' design, not such an edge, and is not listed.")
    bounds: dict[str, list[float]] = Field(description="Each parameter's physical range.")
    runs: list[CalibratedRun]
    fit_mape: float = Field(description="Mean absolute relative error of the fitted predictions.")
    cross_validated_mape: float | None = Field(
        description="Mean absolute relative error of each run predicted by a fit to the others; null with one run.")
    default_mape: float | None = Field(
        default=None, description="Mean absolute relative error of the runs priced with `default_parameters`: what "
        "the fit improves on. Where `cross_validated_mape` exceeds it, `notes` says so. Null in a calibration stored "
        "before this field.")
    fit_weight: float | None = Field(
        default=None, ge=0, le=1, description="Share of the move from `default_parameters` to the parameters that "
        "fit the runs best that `parameters` take: 1 - k sigma^2 / |move|^2 (k parameters fitted, sigma the cost "
        "model's own error per run on a calibrated published stack, 7.9% in log-time, |move| the runs' log-time "
        "change), at least 0. A fit whose change to the runs' predictions is within that error moves nothing (0: "
        "`parameters` are the defaults); one run measured 1.1x its default prediction moves 31% of the way, 1.3x "
        "91%. Null in a calibration stored before this field, which took the whole fit.")
    covers: CalibrationCoverage | None = Field(
        default=None, description="What the runs span: inside it the fitted parameters interpolate, outside they "
        "extrapolate (published stacks: held-out runs inside 7.4% off on average, outside 5.6%, 5.7% where CP or "
        "EP differ). A calibration stored before this field gets it the next time it is read or used, where the service "
        "kept its runs.")
    notes: list[str] = Field(
        default_factory=list, description="What the fit rests on beyond the measurements: a role whose attention "
        "factor `/v1/detect` did not measure (source `prior`) is priced at the plan's full sequence length with the "
        "cost model's attention-to-linear ratio, not the job's; a fit whose runs, each predicted by a fit to the "
        "others, come out further off than the default parameters price them; a fit that takes only part of its "
        "move (`fit_weight` below 1), and why.")
    refit: CalibrationRefit | None = Field(
        default=None, description="Set when the service refitted the stored runs because a newer cost model prices "
        "them differently under the stored parameters; the fit above is the new one, this is what it replaced. "
        "Null for a calibration still fitted under the current cost model.")


@dataclass(frozen=True)
class AppliedCalibration:
    """A stored calibration as a request applies it."""

    calibration_id: str
    parameters: EfficiencyParams
    covers: CalibrationSpan | None = None  # what its runs span; None for a calibration stored before spans

    @classmethod
    def of(cls, calibration: Calibration) -> AppliedCalibration:
        # A calibration stored before a parameter existed keeps that parameter's default.
        return cls(calibration.calibration_id, EfficiencyParams(**{
            name: calibration.parameters[name] for name in EfficiencyParams.field_names()
            if name in calibration.parameters}),
            calibration.covers.span() if calibration.covers is not None else None)


def with_calibration_scope(plan: Plan, problem: PlanningProblem, calibration: AppliedCalibration | None) -> Plan:
    """`plan` naming each way it goes beyond what `calibration`'s runs span (`predicted.calibration_extrapolates`)."""
    if calibration is None or calibration.covers is None:
        return plan
    stages = [stage for replica in plan.replicas for stage in replica.stages]
    if not stages:
        return plan
    workload = problem.workload
    # ZeRO-2/3 plans run equal replicas (`planner.zero_choice`): any stage's group stands for all.
    reach = shard_reach(plan.zero_stage, plan.dp_shard or len(plan.replicas), stages[0].tp, stages[0].cp,
                        problem.hardware.gpus_per_node)
    span = CalibrationSpan.of(problem.hardware, problem.precision, (s.tp for s in stages),
                              (s.cp for s in stages), plan.ep, workload.model.total_params,
                              plan.micro_batch_size * workload.seq_length, reach)
    predicted = plan.predicted.model_copy(update={"calibration_extrapolates": extrapolations(calibration.covers, span)})
    return plan.model_copy(update={"predicted": predicted})


def parameter_bounds() -> dict[str, list[float]]:
    return {name: [lo, hi] for name, (lo, hi) in CALIBRATION_BOUNDS.items()}
