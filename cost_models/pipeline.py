"""Pipeline time of one replica from its per-stage times (the bubble model)."""

from __future__ import annotations

from collections.abc import Sequence


def pipeline_time_ms(stage_times_ms: Sequence[float], microbatches: int, virtual_stages: int = 1) -> float:
    """Makespan of a 1F1B or interleaved-1F1B pipeline whose stages may be unequal.

    Each stage needs t_i per microbatch (forward + backward). The bottleneck
    stage runs all m microbatches back to back; the others contribute the fill
    and drain, shortened v-fold by interleaving:
        m * max(t) + (sum(t) - max(t)) / v.
    With equal stages this is (m + (p - 1)/v) t, i.e. the textbook bubble
    fraction (p - 1)/(v m).
    """
    if not stage_times_ms:
        return 0.0
    slowest = max(stage_times_ms)
    return microbatches * slowest + (sum(stage_times_ms) - slowest) / virtual_stages


def bubble_fraction(stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle share relative to ideal compute for equal stages: (p - 1) / (v m)."""
    return (stages - 1) / (virtual_stages * microbatches)


def interleaved_group_sizes(microbatches: int, stages: int) -> list[int]:
    """Microbatch groups that visit chunk 0, chunk 1, ... together in interleaved 1F1B.

    Megatron uses groups of p (it needs m % p == 0). For any m: max(1, m // p)
    groups as even as possible, larger first. A group smaller than p
    deadlocks the looped order, and the warm-up is sized by the first group,
    so activation memory grows with it.
    """
    rounds = max(1, microbatches // stages)
    size, larger = divmod(microbatches, rounds)
    return [size + 1] * larger + [size] * (rounds - larger)
