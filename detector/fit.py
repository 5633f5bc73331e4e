"""The job's own time model per role, measured from the telemetry window: T = alpha * N + beta * sum(l^2).

The cost model's attention-to-GEMM ratio (`work.py`) is a prior, not a measurement: another attention kernel,
long packed documents or another GPU change it, and then a device that happens to get the attention-heavy
packs looks slow beside its peers. So each role's attention factor k (beta / alpha = k x the prior's ratio)
is fitted from the window itself:

- Objective: the summed absolute deviation of log(T / (a N + k b Q)) from the offsets it shares (a, b: the
  prior work model; N tokens, Q the summed squared sequence lengths of a device's iteration). Absolute
  deviations of logs make it a median-type estimator: a slow device barely moves the fit while slow
  devices are a minority of the role. The offsets, by role size:
  - three or more devices: one per iteration (the role's scale and any drift of the whole cluster) and one
    per device (its own speed), taken out by median polish (device medians, then iteration medians,
    twice). No two GPUs run at the same speed (a few percent apart), and with iteration offsets alone a
    role of a few devices reads that gap as attention or, under the test below, falls back: 8 devices with
    three of them 3-5% off measured 18 of 20 windows; with device offsets, 20 of 20, within 16%
    (`tests/detection/test_time_model.py`). Where the GPUs are equal the extra offsets cost some precision
    (k at 3: median error 7% over 20 windows, was 4.6%).
  - exactly two devices: the per-iteration difference of their log(T / W), around its median over the
    window (the same offsets, counted once: a two-device polish would repeat each difference twice). With
    iteration offsets alone, the two GPUs' fixed speed gap was left for k to explain: k came out 0.105 and
    2.64 (the ends of the search) for two roles whose truth is 0.84 and 0.83.
  - one device: its own median over the window.
  The pair form needs exactly two devices in the window: a third that reports in some iterations makes the
  role a table (which handles it, with fewer residuals).
- k is searched on a log grid over [1/8, 8] and refined around the best point (so within about [0.105, 9.5]).
- k is identifiable only where the mix Q/N varies (packed documents of varied lengths) more than the noise
  hides. A role takes its own k only when its window pins it: k x 1.5 and k / 1.5 must both be rejected at
  99% by the likelihood-ratio test of median regression (Koenker and Bassett, 1982: 4 x the rise of the
  summed absolute deviation over the residuals' sparsity is chi-squared with one degree of freedom). Only
  those two points are tested: the deviation need not be convex in k, so this is not a confidence
  interval. The sparsity is read as for Gaussian residuals from their median absolute deviation, which a
  minority of slow devices widens far less than a mean would (a slowdown that starts mid-window still
  widens it, and the role then falls back: the error is towards not measuring). In the job's
  pooled fit, a pair role's differences are about sqrt(2) wider than other roles' residuals and share one
  scale with them. Since that scale is itself uncertain on a few residuals, the threshold is Student's t
  squared at the scale's degrees of freedom (0.367 x the residuals, the MAD's efficiency), and fewer than
  16 residuals never pin (residuals: samples less the offsets, less one for k). A two-device role pins
  only on long windows (8 iterations give 6 residuals;
  before this test, 7 differences that lined up by chance gave k 3.4 where the truth is 0.84:
  BENCHMARKS "Measured time models in roles of two devices"). A role that fails it, whose Q/N spans less
  than 10%, which has fewer than `MIN_FIT_SAMPLES` samples or a single device (whose own history a
  slowdown starting mid-window would bend), takes the job's k (the same fit over every role's groups at
  once, held to the same test), and the prior's k = 1 when the job's is not identifiable either.
- alpha (ms per token) and beta (ms per squared token) are then the role's median of T / (a N + k b Q)
  times a and k b: the time model users can read (and calibrate with).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from statistics import median

import numpy as np

from detector.work import WorkModel

MIN_FIT_SAMPLES = 6
MIN_MIX_SPREAD = 1.10  # max / min of Q / N over a role's samples
K_RANGE = (1 / 8, 8.0)
GRID_POINTS = 25
MAX_FIT_SAMPLES = 512  # per fit: more samples sharpen k little and cost time at 4,096 devices
PINNED_WITHIN = 1.5  # a fitted k is used only when the window rules out k x and / this factor ...
PINNING_CONFIDENCE_Z = 2.5758  # ... at 99% (two-sided normal quantile; Student's t for few residuals) ...
MIN_PINNING_RESIDUALS = 16  # ... and never on fewer residuals, where even Student's t misjudges a median's scale
POLISH_SWEEPS = 2  # median polish: device then iteration medians, twice
MAD_EFFICIENCY = 0.367  # a median absolute deviation is worth this fraction of its residuals as degrees of freedom


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


@dataclass(frozen=True)
class _Group:
    """Samples of one role whose log(T / W) carry unknown offsets, and how they are taken out:
    `history`: one device's iterations, one offset (its median); `pairs`: (first, second) samples of a
    two-device role per iteration, whose differences share one offset; `table`: the iterations of a role of
    three or more devices, one offset per device and per iteration (two-way median polish)."""

    prior: WorkModel
    samples: tuple[Sample, ...] | tuple[tuple[Sample, Sample], ...]
    kind: str = "history"

    @property
    def pairs(self) -> bool:
        return self.kind == "pairs"

    @property
    def offsets(self) -> int:
        if self.kind != "table":
            return 1
        return len({s.device for s in self.samples}) + len({s.iteration for s in self.samples}) - 1

    def residual_logs(self, k: float) -> np.ndarray:
        """log(T / W) of each sample (each pair's difference) at factor k, its offsets taken out as the kind says;
        evaluated some 40 times per fit, so on arrays built once (`_columns`)."""
        linear, quadratic = self.prior.linear, k * self.prior.quadratic
        observed, tokens, squared = self._columns
        logs = np.log(observed / (linear * tokens + quadratic * squared))
        if self.kind == "pairs":
            return logs[0::2] - logs[1::2]
        if self.kind == "table":
            table = self._table
            if table is not None:
                grid = logs[table].copy()  # devices x iterations
                for _ in range(POLISH_SWEEPS):
                    grid -= np.median(grid, axis=1, keepdims=True)
                    grid -= np.median(grid, axis=0, keepdims=True)
                return grid.ravel()
            # Ragged (devices missing iterations): part by part, where numpy's per-call cost outweighs its speed.
            values = logs.tolist()
            for _ in range(POLISH_SWEEPS):
                _center(values, self._by_device)
                _center(values, self._by_iteration)
            return np.array(values)
        return logs

    @cached_property
    def _columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Observed ms, tokens and squared lengths of every sample (a pair's first then second)."""
        flat = [s for pair in self.samples for s in pair] if self.kind == "pairs" else list(self.samples)
        return (np.array([s.observed_ms for s in flat], dtype=float), np.array([s.tokens for s in flat], dtype=float),
                np.array([s.squared_lengths for s in flat], dtype=float))

    @cached_property
    def _table(self) -> np.ndarray | None:
        """Sample indices as a devices x iterations grid when every device has every iteration once (a window's
        usual shape); None otherwise, and the polish goes part by part."""
        devices = sorted({s.device for s in self.samples})
        iterations = sorted({s.iteration for s in self.samples})
        if len(devices) * len(iterations) != len(self.samples):
            return None
        row = {device: i for i, device in enumerate(devices)}
        column = {iteration: j for j, iteration in enumerate(iterations)}
        grid = np.full((len(devices), len(iterations)), -1, dtype=int)
        for index, s in enumerate(self.samples):
            grid[row[s.device], column[s.iteration]] = index
        return None if (grid < 0).any() else grid

    @cached_property
    def _by_device(self) -> list[list[int]]:
        return _partition([s.device for s in self.samples])

    @cached_property
    def _by_iteration(self) -> list[list[int]]:
        return _partition([s.iteration for s in self.samples])

    def thinned(self, every: int) -> _Group:
        """Every n-th pair or history sample; a table's every n-th device, or iteration where it has more of
        those (a table thinned to one iteration or one device would keep no residual)."""
        if self.kind != "table":
            return replace(self, samples=self.samples[::every])
        devices = sorted({s.device for s in self.samples})
        iterations = sorted({s.iteration for s in self.samples})
        if len(devices) >= len(iterations):
            kept_devices = set(devices[::every])
            return replace(self, samples=tuple(s for s in self.samples if s.device in kept_devices))
        kept_iterations = set(iterations[::every])
        return replace(self, samples=tuple(s for s in self.samples if s.iteration in kept_iterations))


def _partition(keys: Sequence[object]) -> list[list[int]]:
    """Indices of the values sharing each key."""
    by_key: dict[object, list[int]] = {}
    for index, key in enumerate(keys):
        by_key.setdefault(key, []).append(index)
    return list(by_key.values())


def _center(values: list[float], partition: list[list[int]]) -> None:
    """Each value less the median of its part, in place."""
    for part in partition:
        center = median([values[i] for i in part])
        for i in part:
            values[i] -= center


def _groups(prior: WorkModel, samples: Sequence[Sample]) -> list[_Group]:
    devices = sorted({s.device for s in samples})
    if len(devices) == 2:
        by_iteration: dict[int, dict[str, Sample]] = {}
        for sample in samples:
            by_iteration.setdefault(sample.iteration, {})[sample.device] = sample
        pairs = tuple((both[devices[0]], both[devices[1]]) for _, both in sorted(by_iteration.items())
                      if len(both) == 2)
        return [_Group(prior, pairs, "pairs")] if len(pairs) >= 2 else []
    if len(devices) == 1:
        return [_Group(prior, tuple(samples))] if len(samples) >= 2 else []
    return [_Group(prior, tuple(samples), "table")] if len({s.iteration for s in samples}) >= 2 else []


def _deviation(groups: Sequence[_Group], k: float) -> float:
    total = 0.0
    for group in groups:
        logs = group.residual_logs(k)
        total += float(np.abs(logs - np.median(logs)).sum())
    return total


def _best_factor(groups: Sequence[_Group]) -> float:
    lo, hi = math.log(K_RANGE[0]), math.log(K_RANGE[1])
    step = (hi - lo) / (GRID_POINTS - 1)
    grid = [lo + i * step for i in range(GRID_POINTS)]
    best = min(grid, key=lambda x: (_deviation(groups, math.exp(x)), abs(x)))
    fine = [best + step * (i / 5 - 1) for i in range(11)]
    return math.exp(min(fine, key=lambda x: (_deviation(groups, math.exp(x)), abs(x))))


def _sparsity(groups: Sequence[_Group], k: float) -> float:
    """1 / (the residuals' density at 0), read as Gaussian from their median absolute deviation: sqrt(2 pi) x
    1.4826 x median |residual|. Robust (a minority of slow devices, whose offsets k barely moves, widens it
    far less than a mean) and conservative for heavier tails than Gaussian. Each group's smallest residual is dropped, since its offset
    fits it, and the smallest overall, since k does."""
    parts = []
    for group in groups:
        logs = group.residual_logs(k)
        parts.append(np.sort(np.abs(logs - np.median(logs)))[group.offsets:])
    kept = np.sort(np.concatenate(parts))[1:] if parts else np.array([])
    return math.sqrt(2 * math.pi) * 1.4826 * float(np.median(kept)) if kept.size else 0.0


def _t_quantile(z: float, dof: float) -> float:
    """Student's t quantile from the normal one (Cornish-Fisher, Abramowitz and Stegun 26.7.5; within 0.1% of
    the exact 99.5% quantile from 5 degrees of freedom up)."""
    return (z + (z**3 + z) / (4 * dof) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * dof**3)
            + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * dof**4))


def _pinned(groups: Sequence[_Group], k: float) -> bool:
    """Whether the window rules out k x and / PINNED_WITHIN (see the module docstring)."""
    residuals = sum(len(group.samples) - group.offsets for group in groups) - 1  # the offsets, and k
    sparsity = _sparsity(groups, k)
    if residuals < MIN_PINNING_RESIDUALS or sparsity <= 0:
        return False
    best = _deviation(groups, k)
    worse = min(_deviation(groups, k * PINNED_WITHIN), _deviation(groups, k / PINNED_WITHIN)) - best
    return 4 * worse / sparsity >= _t_quantile(PINNING_CONFIDENCE_Z, MAD_EFFICIENCY * residuals) ** 2


def _measured_factor(groups: Sequence[_Group]) -> float | None:
    """The best k where the window pins it, else None."""
    capped = _capped(groups)
    k = _best_factor(capped)
    return k if _pinned(capped, k) else None


def _usable(samples: Sequence[Sample]) -> list[Sample]:
    return [s for s in samples if s.tokens > 0 and s.observed_ms > 0]


def _capped(groups: Sequence[_Group]) -> list[_Group]:
    """At most about MAX_FIT_SAMPLES samples (deterministic): each group thinned alike, none dropped (a group
    is a whole role)."""
    total = sum(len(group.samples) for group in groups)
    every = max(1, math.ceil(total / MAX_FIT_SAMPLES))
    if every == 1:
        return list(groups)
    thinned = [group.thinned(every) for group in groups]
    return [group for group in thinned if len(group.samples) > group.offsets]


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
    groups_by_role = [_groups(prior, samples) for prior, samples in zip(priors, usable, strict=True)]
    job_groups = [group for groups in groups_by_role for group in groups]
    pooled = [s for samples in usable for s in samples]
    job_k = _measured_factor(job_groups) if measure and job_groups and _identifiable(pooled) else None
    fits = []
    for prior, samples, groups in zip(priors, usable, groups_by_role, strict=True):
        # A lone device's own history would let a slowdown that starts mid-window bend its factor.
        role_k = _measured_factor(groups) if measure and groups and len({s.device for s in samples}) > 1 \
            and _identifiable(samples) else None
        if role_k is not None:
            k, source = role_k, "role"
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
