"""Layer splits of one pipeline whose stage times are affine in their layer counts: the least bottleneck
under per-stage memory caps, then the least sum (what a non-uniform replica shape runs)."""

from __future__ import annotations

import math


def best_split(
    per_layer_ms: list[float], fixed_ms: list[float], caps: list[int], layers: int, unit: int
) -> tuple[int, ...] | None:
    """Min-bottleneck, then min-sum split in multiples of `unit` layers; None if nothing fits."""
    units = layers // unit
    stages = len(per_layer_ms)
    unit_caps = [min(c // unit, units) for c in caps]
    if layers % unit or units < stages or min(unit_caps) < 1 or sum(unit_caps) < units:
        return None
    per_unit = [a * unit for a in per_layer_ms]
    bottleneck = _least_bottleneck(per_unit, fixed_ms, unit_caps, units)
    if bottleneck is None:
        return None
    return tuple(n * unit for n in split_within(bottleneck, per_unit, fixed_ms, unit_caps, units))


def split_within(
    bottleneck: float, per_unit: list[float], fixed_ms: list[float], unit_caps: list[int], units: int
) -> list[int]:
    """Units per stage, none above `bottleneck`, with the least sum: every stage one, the rest to
    the stages with the smallest time per unit first."""
    stages = len(per_unit)
    limits = [min(unit_caps[i], int((bottleneck - fixed_ms[i]) / per_unit[i] + 1e-9)) for i in range(stages)]
    split = [1] * stages
    remaining = units - stages
    for i in sorted(range(stages), key=lambda i: (per_unit[i], i)):
        extra = min(remaining, limits[i] - 1)
        split[i] += extra
        remaining -= extra
    return split


def _units_within(bottleneck: float, per_unit: list[float], fixed_ms: list[float], unit_caps: list[int]) -> int:
    """Most units the stages hold with none above `bottleneck`; -1 if some stage cannot hold one."""
    total = 0
    for a, b, cap in zip(per_unit, fixed_ms, unit_caps):
        most = min(cap, int((bottleneck - b) / a + 1e-9)) if a > 0 else cap
        if most < 1:
            return -1
        total += most
    return total


def _least_bottleneck(per_unit: list[float], fixed_ms: list[float], unit_caps: list[int], units: int) -> float | None:
    """The least stage time n a_i + b_i (1 <= n <= cap_i) within which the stages hold `units`.

    Holding is monotone in the bottleneck and changes only at those values. Rounding down loses
    less than one unit per stage, so the least one is at or above the bottleneck where the
    continuous relaxation holds exactly `units`, and within a few values of it: walk them up
    from there in increasing order.
    """
    start = _continuous_bottleneck(per_unit, fixed_ms, unit_caps, units)
    start -= 1e-7 * (1.0 + abs(start))  # the walk may start low; only rounding must not skip the answer
    counts = [max(1, math.ceil((start - b) / a)) if a > 0 else 1 for a, b in zip(per_unit, fixed_ms)]
    while True:
        values = [n * a + b for n, a, b, cap in zip(counts, per_unit, fixed_ms, unit_caps) if n <= cap]
        if not values:
            return None
        value = min(values)
        if _units_within(value, per_unit, fixed_ms, unit_caps) >= units:
            return value
        counts = [n + 1 if n * a + b <= value else n for n, a, b in zip(counts, per_unit, fixed_ms)]


def _continuous_bottleneck(per_unit: list[float], fixed_ms: list[float], unit_caps: list[int], units: int) -> float:
    """Least M >= max(a_i + b_i) with sum_i min(cap_i, (M - b_i) / a_i) >= units: piecewise
    linear in M, with a kink where each stage reaches its cap."""
    low = max(a + b for a, b in zip(per_unit, fixed_ms))
    held = float(sum(cap for a, cap in zip(per_unit, unit_caps) if a <= 0))
    rate = offset = 0.0  # units held below the caps: M * rate - offset
    kinks = []
    for a, b, cap in zip(per_unit, fixed_ms, unit_caps):
        if a <= 0:
            continue
        if cap * a + b <= low:
            held += cap
        else:
            rate += 1 / a
            offset += b / a
            kinks.append((cap * a + b, cap, a, b))
    for kink, cap, a, b in sorted(kinks):
        if held + kink * rate - offset >= units:
            return max(low, (units - held + offset) / rate)
        held += cap
        rate -= 1 / a
        offset -= b / a
        low = kink
    return low
