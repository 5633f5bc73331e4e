"""Fit the cost model's efficiency parameters to iteration times a user measured on their cluster.

Each run is a fixed layout (what `/v1/estimate` prices) and the iteration time measured for it. The
fit works on log-times and log-parameters, so every run weighs the same whatever its length and
every parameter moves by factors:

1. Sensitivities: how much each parameter moves each run's log-time (a 10% step, inside its
   bounds), at the starting parameters (the built-in fit).
2. Identifiable parameters: greedily, the one whose sensitivity column is farthest from what the
   parameters already chosen can explain, while that distance is at least `MIN_EFFECT` (a change of
   the parameter by a factor e moves some run by 5% that no chosen parameter can mimic), and never
   more parameters than runs. The rest keep their starting values: the runs cannot tell them
   apart (a single run cannot separate GEMM efficiency from HBM efficiency, say) and the answer
   names them.
3. Damped Gauss-Newton on the chosen parameters, each kept inside its physical range
   (`CALIBRATION_BOUNDS`); a parameter that ends on a bound is reported as such.
4. Shrinkage toward the start. A fit to a few runs also fits the cost model's own error on them, and
   carries it to other layouts. Noise of variance sigma^2 per run (`RUN_NOISE_LOG`, in log-time) moves
   a fit of k parameters by k sigma^2 in squared log-time over the runs, on average (its projection onto
   the k directions the parameters span). So the answer takes the share 1 - k sigma^2 / |move|^2 of the
   fit's move from the start (none when the move is within the noise), where |move| is the norm of the
   runs' log-time change from the start's predictions to the fit's: positive-part James-Stein. One run
   measured 1.05x the start's prediction moves nothing, 1.1x 31% of the way, 1.3x 91%. Published stacks, their other
   runs predicted from 1 to 3 calibrated: KempnerForge 10.5-10.7% -> 9.3-9.6% median, torchtitan 2024
   10.2-11.0% -> 9.1-9.3% (BENCHMARKS.md, calibration transfer).
5. Leave-one-out: every run predicted by steps 1-4 on the others; their mean absolute error is the
   calibration's honest error on runs it has not seen.

A run may instead be one role's compute per microbatch that `/v1/detect` measured from a job's telemetry
(`MeasuredCompute`: its time model at one microbatch of the plan's sequences), priced as the cost model's
compute of that stage shape on one GPU, without TP, CP or EP traffic: such runs determine the compute
parameters (GEMM and HBM efficiency, the per-layer overhead) and leave the links' unidentified.

Steps 1-3 evaluate hundreds of parameter sets, so they price each run with the bubble model (no
schedule timeline: milliseconds, where simulating a 64-stage pipeline of 512 microbatches takes a
second), scaled by that run's ratio of simulated to bubble-model time at the starting parameters.
The errors reported (fit and leave-one-out) are of the simulated prediction a plan would show.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from cost_models.efficiency import CALIBRATION_BOUNDS, DESIGN_BOUNDS, EfficiencyParams
from cost_models.layout import ParallelShape
from cost_models.stage_costs import PartCosts, part_costs
from planner.estimate import FixedLayout, bubble_model_s, estimate_layout
from planner.estimate_replicas import ReplicaLayout, estimate_replicas
from planner.problem import PlanningProblem

PRIOR_WEIGHT = 0.01  # squared log-time error that moving a parameter by a factor e costs (see below)
MIN_EFFECT = 0.05  # least unexplained d log(time) / d log(parameter) over the runs (Euclidean norm)
_STEP = math.log(1.1)  # finite-difference step in log-parameter
_MAX_ITERATIONS = 12
_CONVERGED = 1e-4  # largest log-parameter step that still counts as moving
# The cost model's error per run (standard deviation of log-time) on a stack calibrated on all its runs: the
# published 2023+ stacks' residuals, over 75 runs less 27 fitted parameters (`python -m
# benchmarks.calibration_transfer` prints it). A run's deviation from the start within this says nothing
# about the stack's parameters.
RUN_NOISE_LOG = 0.079


@dataclass(frozen=True)
class MeasuredRun:
    problem: PlanningProblem
    layout: FixedLayout | ReplicaLayout
    measured_s: float


@dataclass(frozen=True)
class RunError:
    measured_s: float
    predicted_s: float

    @property
    def error(self) -> float:
        """Relative error of the prediction: predicted / measured - 1."""
        return self.predicted_s / self.measured_s - 1


@dataclass(frozen=True)
class CalibrationFit:
    parameters: EfficiencyParams
    fitted: tuple[str, ...]  # identified by the runs, and moved `fit_weight` of the whole fit's way
    unidentified: tuple[str, ...]  # kept at the starting value: the runs cannot determine them
    at_bound: tuple[str, ...]  # fitted, but the whole fit stopped at the edge of the physical range
    runs: tuple[RunError, ...]
    fit_mape: float
    cross_validated_mape: float | None  # leave-one-out; None with one run
    cross_validated: tuple[RunError, ...]  # each run as predicted by the fit on the others
    default_mape: float  # the starting parameters' mean absolute error on the runs
    fit_weight: float  # share of the move from the start to the runs' best fit that `parameters` take


def predicted_s(run: MeasuredRun, parameters: EfficiencyParams) -> float:
    """The run's predicted iteration time under `parameters`: what `/v1/estimate` answers."""
    problem = replace(run.problem, efficiency=parameters)
    if isinstance(run.layout, ReplicaLayout):
        return estimate_replicas(problem, run.layout).predicted.iteration_time_s
    return estimate_layout(problem, run.layout).predicted.iteration_time_s


def fast_predicted_s(run: MeasuredRun, parameters: EfficiencyParams) -> float:
    return bubble_model_s(replace(run.problem, efficiency=parameters), run.layout)


@dataclass(frozen=True)
class MeasuredCompute:
    """One role's compute per microbatch on one GPU, measured from a job's telemetry: `layers` layers of a
    stage of `shape`, with the embedding and the head where the role holds them, at full speed."""

    problem: PlanningProblem
    shape: ParallelShape
    layers: int
    embedding: bool
    head: bool
    measured_s: float


def compute_predicted_s(run: MeasuredCompute, parameters: EfficiencyParams) -> float:
    """The cost model's compute of one microbatch of the role under `parameters`: forward and backward
    (recomputation included), no TP, CP or EP traffic, which the detector's per-device compute leaves out."""
    parts = part_costs(run.problem.workload, run.problem.hardware, run.shape, parameters, run.problem.software)

    def compute_ms(part: PartCosts) -> float:
        return part.time.forward_compute_ms + part.time.backward_compute_ms

    ms = run.layers * compute_ms(parts.layer)
    ms += compute_ms(parts.embedding) if run.embedding else 0.0
    ms += compute_ms(parts.head) if run.head else 0.0
    return ms / 1e3


def _fast_s(run: MeasuredRun | MeasuredCompute, parameters: EfficiencyParams) -> float:
    return compute_predicted_s(run, parameters) if isinstance(run, MeasuredCompute) else fast_predicted_s(run, parameters)


def exact_predicted_s(run: MeasuredRun | MeasuredCompute, parameters: EfficiencyParams) -> float:
    """What a calibration reports for a run: `predicted_s`, or a role's `compute_predicted_s`."""
    return compute_predicted_s(run, parameters) if isinstance(run, MeasuredCompute) else predicted_s(run, parameters)


Predictor = Callable[[MeasuredRun, EfficiencyParams], float]
_NAMES = tuple(EfficiencyParams.field_names())
_LOG_BOUNDS = {name: (math.log(lo), math.log(hi)) for name, (lo, hi) in CALIBRATION_BOUNDS.items()}
_LOG_DESIGN_BOUNDS = {name: math.log(value) for name, value in DESIGN_BOUNDS.items()}


def _with(start: EfficiencyParams, names: Sequence[str], logs: Sequence[float]) -> EfficiencyParams:
    return replace(start, **{name: math.exp(x) for name, x in zip(names, logs)})


def _clamped(name: str, x: float) -> float:
    lo, hi = _LOG_BOUNDS[name]
    return min(max(x, lo), hi)


class _Pricer:
    """Log-predictions of the runs, memoized per parameter set (the fit revisits points): the fast
    model's, plus each run's log-ratio of exact to fast prediction at the starting parameters."""

    def __init__(self, runs: Sequence[MeasuredRun], start: EfficiencyParams, fast: Predictor, exact: Predictor) -> None:
        self._runs = runs
        self._fast = fast
        self._exact = exact
        self._memo: dict[tuple[int, EfficiencyParams], float] = {}
        self.start_s = [exact(run, start) for run in runs]
        self._shift = [math.log(start_s) - math.log(fast(run, start)) for run, start_s in zip(runs, self.start_s)]

    def log_times(self, indices: Sequence[int], parameters: EfficiencyParams) -> np.ndarray:
        out = []
        for i in indices:
            key = (i, parameters)
            if key not in self._memo:
                self._memo[key] = math.log(self._fast(self._runs[i], parameters)) + self._shift[i]
            out.append(self._memo[key])
        return np.array(out)

    def exact_s(self, i: int, parameters: EfficiencyParams) -> float:
        return self._exact(self._runs[i], parameters)

    def jacobian(self, indices: Sequence[int], start: EfficiencyParams, names: Sequence[str]) -> np.ndarray:
        base = self.log_times(indices, start)
        columns = []
        for name in names:
            x = math.log(getattr(start, name))
            lo, hi = _LOG_BOUNDS[name]
            step = _STEP if x + _STEP <= hi else -_STEP  # step inward from an upper bound
            if not lo <= x + step <= hi:
                step = (hi - lo) / 2
            moved = replace(start, **{name: math.exp(x + step)})
            columns.append((self.log_times(indices, moved) - base) / step)
        return np.column_stack(columns) if columns else np.zeros((len(indices), 0))


def _identifiable(jacobian: np.ndarray, movable: Sequence[bool]) -> list[int]:
    """Columns chosen greedily by the norm of what the chosen ones cannot explain (Gram-Schmidt), among
    the `movable` ones."""
    chosen: list[int] = [k for k, free in enumerate(movable) if not free]  # never chosen: placeholders
    blocked = len(chosen)
    basis: list[np.ndarray] = []
    most = min(jacobian.shape)
    while len(chosen) - blocked < most and len(chosen) < jacobian.shape[1]:
        best, best_norm, best_residual = None, MIN_EFFECT, None
        for k in range(jacobian.shape[1]):
            if k in chosen:
                continue
            residual = jacobian[:, k].copy()
            for q in basis:
                residual -= (q @ residual) * q
            norm = float(np.linalg.norm(residual))
            if norm >= best_norm:
                best, best_norm, best_residual = k, norm, residual
        if best is None:
            break
        chosen.append(best)
        basis.append(best_residual / best_norm)
    return sorted(chosen[blocked:])


def _fit(pricer: _Pricer, indices: Sequence[int], measured: np.ndarray, start: EfficiencyParams,
         ) -> tuple[EfficiencyParams, tuple[str, ...]]:
    """(parameters, names fitted) for the runs `indices`."""
    target = np.log(measured)
    jacobian = pricer.jacobian(indices, start, _NAMES)
    # A parameter on a bound that the runs want to push further out cannot move: never choose it.
    residual = pricer.log_times(indices, start) - target
    movable = []
    for k, name in enumerate(_NAMES):
        x = math.log(getattr(start, name))
        downhill = -float(jacobian[:, k] @ residual)
        lo, hi = _LOG_BOUNDS[name]
        movable.append(not ((downhill > 0 and x >= hi - 1e-9) or (downhill < 0 and x <= lo + 1e-9)))
    names = [_NAMES[k] for k in _identifiable(jacobian, movable)]
    x = np.array([math.log(getattr(start, name)) for name in names])
    if not names:
        return start, ()
    origin = x.copy()
    weight = math.sqrt(PRIOR_WEIGHT)

    def loss_of(logs: np.ndarray, times: np.ndarray) -> float:
        return float(np.sum((times - target) ** 2) + PRIOR_WEIGHT * np.sum((logs - origin) ** 2))

    damping = 1e-3
    current = _with(start, names, x)
    loss = loss_of(x, pricer.log_times(indices, current))
    for _ in range(_MAX_ITERATIONS):
        # The prior is a residual per parameter: its distance from the start, weighted.
        residual = np.concatenate([pricer.log_times(indices, current) - target, weight * (x - origin)])
        jacobian = np.vstack([pricer.jacobian(indices, current, names), weight * np.eye(len(names))])
        while True:
            normal = jacobian.T @ jacobian + damping * np.eye(len(names))
            step = -np.linalg.solve(normal, jacobian.T @ residual)
            trial_x = np.array([_clamped(name, v) for name, v in zip(names, x + step)])
            trial = _with(start, names, trial_x)
            trial_loss = loss_of(trial_x, pricer.log_times(indices, trial))
            if trial_loss <= loss or damping > 1e6:
                break
            damping *= 10
        moved = float(np.max(np.abs(trial_x - x)))
        if trial_loss <= loss:
            x, current, loss = trial_x, trial, trial_loss
            damping = max(damping / 10, 1e-6)
        if moved < _CONVERGED or trial_loss > loss:
            break
    return current, tuple(names)


def _toward(start: EfficiencyParams, fit: EfficiencyParams, weight: float) -> EfficiencyParams:
    """`weight` of the way from `start` to `fit`, in log-parameter."""
    moved = [name for name in _NAMES if getattr(fit, name) != getattr(start, name)]
    if weight in (0.0, 1.0):
        return fit if weight else start
    return _with(start, moved, [(1 - weight) * math.log(getattr(start, name)) + weight * math.log(getattr(fit, name))
                                for name in moved])


def _shrunk(pricer: _Pricer, indices: Sequence[int], measured: np.ndarray, start: EfficiencyParams,
            noise_log: float) -> tuple[EfficiencyParams, tuple[str, ...], float, EfficiencyParams]:
    """Steps 1-4 on the runs `indices`: (parameters, names fitted, share of the fit's move taken, the whole fit)."""
    fit, names = _fit(pricer, indices, measured, start)
    moved = pricer.log_times(indices, fit) - pricer.log_times(indices, start)
    moved_squared = float(moved @ moved)
    noise_squared = len(names) * noise_log ** 2
    weight = max(0.0, 1.0 - noise_squared / moved_squared) if moved_squared > 0 else 0.0
    return _toward(start, fit, weight), names, weight, fit


def calibrate(runs: Sequence[MeasuredRun | MeasuredCompute], start: EfficiencyParams, fast: Predictor = _fast_s,
              exact: Predictor = exact_predicted_s, noise_log: float = RUN_NOISE_LOG) -> CalibrationFit:
    """The parameters that best predict `runs`, starting from (and shrunk toward) `start`; `noise_log` 0 takes
    the whole fit."""
    pricer = _Pricer(runs, start, fast, exact)
    measured = np.array([run.measured_s for run in runs])
    everything = list(range(len(runs)))
    parameters, fitted, fit_weight, whole = _shrunk(pricer, everything, measured, start, noise_log)
    errors = tuple(RunError(run.measured_s, pricer.exact_s(i, parameters)) for i, run in enumerate(runs))
    held_out: list[RunError] = []
    if len(runs) > 1:
        for i in everything:
            others = [j for j in everything if j != i]
            without, _, _, _ = _shrunk(pricer, others, measured[others], start, noise_log)
            held_out.append(RunError(runs[i].measured_s, pricer.exact_s(i, without)))
    # Where the whole fit stopped: shrinking it moves a pinned parameter off its bound, not the runs' demand.
    at_bound = tuple(name for name in fitted
                     if any(math.isclose(math.log(getattr(whole, name)), edge, abs_tol=1e-6)
                            for edge in _LOG_BOUNDS[name] if edge != _LOG_DESIGN_BOUNDS.get(name)))
    return CalibrationFit(
        parameters=parameters,
        fitted=fitted,
        unidentified=tuple(name for name in _NAMES if name not in fitted),
        at_bound=at_bound,
        runs=errors,
        fit_mape=sum(abs(e.error) for e in errors) / len(errors),
        cross_validated_mape=sum(abs(e.error) for e in held_out) / len(held_out) if held_out else None,
        cross_validated=tuple(held_out),
        default_mape=sum(abs(start_s / run.measured_s - 1) for run, start_s in zip(runs, pricer.start_s)) / len(runs),
        fit_weight=fit_weight,
    )
