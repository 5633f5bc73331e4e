"""Fail-stop and fail-slow detection from a window of per-device telemetry.

The detector is stateless: every call judges the window of iterations the
caller sends (send the last `RECOMMENDED_WINDOW` = 8 iterations of every
device; at least `CONSECUTIVE_ITERATIONS` are needed to flag a slow device,
and devices alone in their role need `MIN_BASELINE_ITERATIONS` more).

Fail-stop: a device whose newest item (highest iteration) reports a heartbeat
older than `heartbeat_timeout_s` (default 30 s).

Fail-slow:
1. Per device and iteration, ratio = sum(compute_ms) / sum(expected work) over
   its microbatches; expected work is linear in tokens plus quadratic in each
   packed sequence's length, with the role's attention factor measured from
   the window itself and the cost model only as the prior (`fit.py`; the
   fitted alpha and beta per role are part of the answer).
2. Per role (stages with the same layer range and TP degree) and iteration,
   scale = median ratio of the role's devices reporting that iteration; a
   device's normalized time = ratio / scale (1.0 = as fast as its peers doing
   the same work). Judging per iteration cancels cluster-wide drifts.
   Roles with fewer than `min_role_peers` (3) reporting devices have no robust
   peer median: each such device is compared with itself, scale = median of its
   ratios over the window except the last `consecutive_iterations` (needs
   `min_baseline_iterations` of them). Such a device is seen only while its
   slowdown is younger than about half the window; its confidence is scaled
   by `SELF_BASELINE_CONFIDENCE`. Such devices are also compared with the whole
   job (ratio / the median ratio of every device that iteration), flagged at
   `cross_role_threshold` (1.5: the cost model's work of one stage against
   another is a prior) unless every device of their role is, or the device is
   within `slow_threshold` of its role's others (both mean the role's work is
   misjudged): a slowdown present from the first iteration, which no
   self-baseline sees, is caught this way.
3. A device is fail-slow when its normalized time is >= `slow_threshold`
   (1.15) in each of its last `consecutive_iterations` (3) iterations with
   data. speed = 1 / median normalized time over the trailing run of slow
   iterations (at most `speed_window` = 8), clamped to (0, 1].
   confidence = 0.5 + 0.25 * persistence + 0.25 * margin, where persistence =
   min(1, run / (2 * consecutive_iterations)) and margin = min(1, (smallest
   normalized time of the last consecutive_iterations - threshold) /
   (threshold - 1)); so 0.5 at the bare minimum evidence, 1.0 for a device at
   least 1.3x its peers for 6 iterations.

A slowdown below the threshold (speed above ~0.87, e.g. 0.9) is not reported:
at 3 iterations it cannot be told from a peer that happens to get the
attention-heavy packs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from statistics import median

from cost_models.device import DeviceIdError, device_order
from detector.fit import RoleFit, Sample, fit_roles
from detector.telemetry import ItemTotals, TelemetryError
from detector.work import DetectionLayout

HEARTBEAT_TIMEOUT_S = 30.0
SLOW_THRESHOLD = 1.15
CONSECUTIVE_ITERATIONS = 3
MIN_ROLE_PEERS = 3
MIN_BASELINE_ITERATIONS = 3
SPEED_WINDOW = 8
SELF_BASELINE_CONFIDENCE = 0.8
CROSS_ROLE_THRESHOLD = 1.5
RECOMMENDED_WINDOW = 8


@dataclass(frozen=True)
class DetectorOptions:
    """Thresholds of the rules above; the defaults are the documented constants."""

    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S
    slow_threshold: float = SLOW_THRESHOLD
    consecutive_iterations: int = CONSECUTIVE_ITERATIONS
    min_role_peers: int = MIN_ROLE_PEERS
    min_baseline_iterations: int = MIN_BASELINE_ITERATIONS
    speed_window: int = SPEED_WINDOW
    cross_role_threshold: float = CROSS_ROLE_THRESHOLD
    measure_time_model: bool = True  # False: trust the cost model's attention-to-linear ratio (fit.py)

    def __post_init__(self) -> None:
        if self.heartbeat_timeout_s <= 0:
            raise ValueError("heartbeat_timeout_s must be > 0")
        if self.slow_threshold <= 1 or self.cross_role_threshold <= 1:
            raise ValueError("slow_threshold and cross_role_threshold must be > 1 (normalized times)")
        if self.consecutive_iterations < 1 or self.speed_window < 1 or self.min_baseline_iterations < 1:
            raise ValueError("iteration counts must be >= 1")
        if self.min_role_peers < 2:
            raise ValueError("min_role_peers must be >= 2")


@dataclass(frozen=True)
class DeviceIteration:
    """One telemetry item reduced to what the rules use."""

    device: str
    iteration: int
    observed_ms: float
    expected: float  # work units of the cost model's prior; 0 when the item has no microbatches
    last_heartbeat_s_ago: float
    tokens: int = 0
    squared_lengths: int = 0

    @property
    def ratio(self) -> float | None:
        return self.observed_ms / self.expected if self.expected > 0 else None


@dataclass(frozen=True)
class FailSlow:
    device: str
    speed: float  # fraction of healthy speed, (0, 1]
    confidence: float  # [0, 1]
    normalized_time: float  # median normalized time behind `speed`
    slow_iterations: int  # length of the trailing run of slow iterations
    reference: str  # "peers" or "self"


@dataclass(frozen=True)
class Detection:
    fail_slow: tuple[FailSlow, ...]
    fail_stop: tuple[str, ...]
    time_models: tuple[RoleFit, ...] = ()  # per role of the layout, in its order (fit.py)


def device_sort_key(device: str) -> tuple[int, int, str]:
    """Numeric device order; an id that is not one (the detector reports what it was sent) sorts last."""
    try:
        return (*device_order(device), device)
    except DeviceIdError:
        return (1 << 62, 0, device)


def summarize(items: Iterable[ItemTotals], layout: DetectionLayout) -> list[DeviceIteration]:
    """Check every item (a TelemetryItem or its TelemetryTotals) against the layout and reduce it;
    TelemetryError on unknown devices or duplicates."""
    summaries: list[DeviceIteration] = []
    unknown: list[str] = []
    seen: set[tuple[str, int]] = set()
    for item in items:
        role_index = layout.role_of.get(item.device)
        if role_index is None:
            if item.device not in unknown:
                unknown.append(item.device)
            continue
        key = (item.device, item.iteration)
        if key in seen:
            raise TelemetryError(f"telemetry has two items for device {item.device} iteration {item.iteration}")
        seen.add(key)
        work = layout.roles[role_index].work
        summaries.append(
            DeviceIteration(
                device=item.device,
                iteration=item.iteration,
                observed_ms=item.compute_ms,
                expected=work.expected_for(item.tokens, item.squared_lengths),
                last_heartbeat_s_ago=item.last_heartbeat_s_ago,
                tokens=item.tokens,
                squared_lengths=item.squared_lengths,
            )
        )
    if unknown:
        shown = ", ".join(sorted(unknown, key=device_sort_key)[:8])
        more = f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""
        raise TelemetryError(f"telemetry names devices that are in none of the plan's stages: {shown}{more}")
    return summaries


def _normalized_by_peers(
    ratios: dict[str, dict[int, float]], devices: list[str], min_peers: int
) -> dict[str, list[tuple[int, float]]]:
    by_iteration: dict[int, list[tuple[str, float]]] = {}
    for device in devices:
        for iteration, ratio in ratios[device].items():
            by_iteration.setdefault(iteration, []).append((device, ratio))
    normalized: dict[str, list[tuple[int, float]]] = {device: [] for device in devices}
    for iteration, reports in by_iteration.items():
        if len(reports) < min_peers:
            continue
        scale = median(ratio for _, ratio in reports)
        if scale <= 0:
            continue
        for device, ratio in reports:
            normalized[device].append((iteration, ratio / scale))
    return normalized


def _normalized_by_self(series: dict[int, float], options: DetectorOptions) -> list[tuple[int, float]]:
    iterations = sorted(series)
    baseline = iterations[: len(iterations) - options.consecutive_iterations]
    if len(baseline) < options.min_baseline_iterations:
        return []
    scale = median(series[iteration] for iteration in baseline)
    if scale <= 0:
        return []
    return [(iteration, series[iteration] / scale) for iteration in iterations]


def _judge(
    device: str, normalized: list[tuple[int, float]], reference: str, options: DetectorOptions,
    threshold: float | None = None,
) -> FailSlow | None:
    values = [value for _, value in sorted(normalized)]
    need = options.consecutive_iterations
    threshold = threshold or options.slow_threshold
    if len(values) < need or any(value < threshold for value in values[-need:]):
        return None
    run = 0
    for value in reversed(values):
        if value < threshold:
            break
        run += 1
    typical = median(values[-min(run, options.speed_window):])
    speed = min(1.0, max(1e-3, 1.0 / typical))
    persistence = min(1.0, run / (2 * need))
    margin = min(1.0, (min(values[-need:]) - threshold) / (threshold - 1))
    confidence = 0.5 + 0.25 * persistence + 0.25 * margin
    if reference != "peers":
        confidence *= SELF_BASELINE_CONFIDENCE
    return FailSlow(
        device=device,
        speed=round(speed, 4),
        confidence=round(confidence, 3),
        normalized_time=typical,
        slow_iterations=run,
        reference=reference,
    )


def decide(
    summaries: Iterable[DeviceIteration], layout: DetectionLayout, options: DetectorOptions | None = None
) -> Detection:
    """The rules of the module docstring over already summarized telemetry."""
    options = options or DetectorOptions()
    summaries = list(summaries)
    newest: dict[str, DeviceIteration] = {}
    samples: list[list[Sample]] = [[] for _ in layout.roles]
    for summary in summaries:
        current = newest.get(summary.device)
        if current is None or summary.iteration > current.iteration:
            newest[summary.device] = summary
        if summary.expected > 0:
            samples[layout.role_of[summary.device]].append(Sample(
                summary.device, summary.iteration, summary.tokens, summary.squared_lengths, summary.observed_ms))
    fits = fit_roles([role.work for role in layout.roles], samples, options.measure_time_model)
    ratios: dict[str, dict[int, float]] = {}
    for role_samples, fit in zip(samples, fits, strict=True):
        for sample in role_samples:
            expected = fit.work.expected_for(sample.tokens, sample.squared_lengths)
            if expected > 0:
                ratios.setdefault(sample.device, {})[sample.iteration] = sample.observed_ms / expected
    fail_stop = sorted(
        (device for device, summary in newest.items() if summary.last_heartbeat_s_ago > options.heartbeat_timeout_s),
        key=device_sort_key,
    )
    stopped = set(fail_stop)

    # Devices of small roles are also compared with the whole job, each iteration's time over its role's
    # measured work divided by the median over every device: across roles the cost model's work is a prior
    # (a stage it misjudges looks off by that much), hence the higher `cross_role_threshold`.
    job: dict[str, list[tuple[int, float]]] | None = None
    findings: list[FailSlow] = []
    for role in layout.roles:
        reporting = [device for device in role.devices if device in ratios]
        if len(reporting) >= options.min_role_peers:
            normalized = _normalized_by_peers(ratios, reporting, options.min_role_peers)
            found = [_judge(device, normalized[device], "peers", options) for device in reporting]
        else:
            if job is None:
                job = _normalized_by_peers(ratios, sorted(ratios, key=device_sort_key), options.min_role_peers)
            by_job = [_judge(device, job[device], "job", options, options.cross_role_threshold)
                      for device in reporting]
            if len(reporting) > 1 and all(by_job):
                by_job = [None] * len(reporting)  # the whole role off the job: its work is misjudged, not its GPUs
            elif len(reporting) > 1:
                # Off the job but level with its own role's others (which do the same work): the role's work is
                # what the cost model misjudged, the others only a little less. A slowdown strong enough to be
                # off the job is also off a partner that has none.
                within = _normalized_by_peers(ratios, reporting, 2)
                by_job = [finding if finding is None or _judge(device, within[device], "peers", options) else None
                          for device, finding in zip(reporting, by_job, strict=True)]
            found = [job_finding or _judge(device, _normalized_by_self(ratios[device], options), "self", options)
                     for device, job_finding in zip(reporting, by_job, strict=True)]
        findings += [f for f in found if f is not None and f.device not in stopped]
    findings.sort(key=lambda finding: device_sort_key(finding.device))
    return Detection(fail_slow=tuple(findings), fail_stop=tuple(fail_stop), time_models=tuple(fits))


def detect(
    items: Iterable[ItemTotals], layout: DetectionLayout, options: DetectorOptions | None = None
) -> Detection:
    """Fail-slow and fail-stop devices in one telemetry window."""
    return decide(summarize(items, layout), layout, options)
