"""The job's own time model per role, measured from the telemetry window: T = alpha * N + beta * sum(l^2).

The cost model's attention-to-GEMM ratio (`work.py`) is a prior, not a measurement: another attention kernel,
long packed documents or another GPU change it, and then a device that happens to get the attention-heavy
packs looks slow beside its peers. So each role's attention factor k (beta / alpha = k x the prior's ratio)
is fitted from the window itself:

- Objective: the summed absolute deviation of log(T / (a N + k b Q)) from its median within each group
  (a, b: the prior work model; N tokens, Q the summed squared sequence lengths of a device's iteration).
  A group is one iteration of the role's devices (the median absorbs the role's scale and any drift of the
  whole cluster), or, in a role with a single reporting device, that device's iterations.
  Absolute deviations of logs make it a median-type estimator: a slow device is a constant offset that
  barely moves the fit while slow devices are a minority of the role.
- k is searched on a log grid over [1/8, 8] and refined around the best point.
- k is identifiable only where the mix Q/N varies (packed documents of varied lengths): a role whose Q/N
  spans less than 10%, which has fewer than `MIN_FIT_SAMPLES` samples or a single device (whose own history
  a slowdown starting mid-window would bend), takes the job's k (the same fit over every role's groups at
  once), and the prior's k = 1 when the job's is not identifiable either.
- alpha (ms per token) and beta (ms per squared token) are then the role's median of T / (a N + k b Q)
  times a and k b: the time model users can read (and calibrate with).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median

from detector.work import WorkModel

MIN_FIT_SAMPLES = 6
MIN_MIX_SPREAD = 1.10  # max / min of Q / N over a role's samples
K_RANGE = (1 / 8, 8.0)
GRID_POINTS = 25
MAX_FIT_SAMPLES = 512  # per fit: more samples sharpen k little and cost time at 4,096 devices


@dataclass(frozen=True)
class Sample:
    """One device-iteration of a role."""

    device: str
    iteration: int
    tokens: int
    squared_lengths: int
    observed_ms: float


@dataclass(frozen=True)
class RoleFit:
    """A role's measured time model."""

    work: WorkModel  # the prior's linear term and k x its quadratic term (work units, as the prior)
    attention_factor: float  # k: measured attention-to-linear cost over the cost model's
    source: str  # "role" (fitted on its own samples), "job" (the job's factor), "prior" (k = 1)
    alpha_ms_per_token: float | None  # None without samples
    beta_ms_per_token_squared: float | None


def _groups(samples: Sequence[Sample]) -> list[list[Sample]]:
    devices = {s.device for s in samples}
    key = (lambda s: s.device) if len(devices) == 1 else (lambda s: s.iteration)
    grouped: dict[object, list[Sample]] = {}
    for sample in samples:
        grouped.setdefault(key(sample), []).append(sample)
    return [group for group in grouped.values() if len(group) >= 2]


def _deviation(groups: list[tuple[WorkModel, list[Sample]]], k: float) -> float:
    total = 0.0
    for prior, group in groups:
        logs = [math.log(s.observed_ms / (prior.linear * s.tokens + k * prior.quadratic * s.squared_lengths))
                for s in group]
        center = median(logs)
        total += sum(abs(value - center) for value in logs)
    return total


def _best_factor(groups: list[tuple[WorkModel, list[Sample]]]) -> float:
    lo, hi = math.log(K_RANGE[0]), math.log(K_RANGE[1])
    step = (hi - lo) / (GRID_POINTS - 1)
    grid = [lo + i * step for i in range(GRID_POINTS)]
    best = min(grid, key=lambda x: (_deviation(groups, math.exp(x)), abs(x)))
    fine = [best + step * (i / 5 - 1) for i in range(11)]
    return math.exp(min(fine, key=lambda x: (_deviation(groups, math.exp(x)), abs(x))))


def _usable(samples: Sequence[Sample]) -> list[Sample]:
    return [s for s in samples if s.tokens > 0 and s.observed_ms > 0]


def _capped(groups: list[tuple[WorkModel, list[Sample]]]) -> list[tuple[WorkModel, list[Sample]]]:
    """Every n-th group, at most about MAX_FIT_SAMPLES samples (deterministic)."""
    total = sum(len(group) for _, group in groups)
    every = max(1, math.ceil(total / MAX_FIT_SAMPLES))
    return groups[::every]


def _identifiable(samples: Sequence[Sample]) -> bool:
    if len(samples) < MIN_FIT_SAMPLES:
        return False
    mixes = [s.squared_lengths / s.tokens for s in samples]
    return min(mixes) > 0 and max(mixes) / min(mixes) >= MIN_MIX_SPREAD


def fit_roles(priors: Sequence[WorkModel], samples_by_role: Sequence[Sequence[Sample]],
              measure: bool = True) -> list[RoleFit]:
    """Each role's time model (see the module docstring), in the order of `priors`; `measure=False` keeps the
    prior's attention factor (only alpha and beta's scale are read from the samples)."""
    usable = [_usable(samples) for samples in samples_by_role]
    job_groups = [(prior, group) for prior, samples in zip(priors, usable, strict=True)
                  for group in _groups(samples)]
    pooled = [s for samples in usable for s in samples]
    job_k = _best_factor(_capped(job_groups)) if measure and job_groups and _identifiable(pooled) else None
    fits = []
    for prior, samples in zip(priors, usable, strict=True):
        groups = [(prior, group) for group in _groups(samples)]
        # A lone device's own history would let a slowdown that starts mid-window bend its factor.
        if measure and groups and len({s.device for s in samples}) > 1 and _identifiable(
                [s for _, g in groups for s in g]):
            k, source = _best_factor(_capped(groups)), "role"
        elif job_k is not None:
            k, source = job_k, "job"
        else:
            k, source = 1.0, "prior"
        work = WorkModel(linear=prior.linear, quadratic=k * prior.quadratic)
        scale = median(s.observed_ms / work.expected_for(s.tokens, s.squared_lengths) for s in samples) \
            if samples else None
        fits.append(RoleFit(work, k, source, None if scale is None else scale * work.linear,
                            None if scale is None else scale * work.quadratic))
    return fits
