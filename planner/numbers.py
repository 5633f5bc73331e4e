"""Integer arithmetic the search spaces are built from."""

from __future__ import annotations


def divisors(value: int) -> list[int]:
    """The divisors of `value`, ascending, in O(sqrt value) (batches reach 65,536 sequences)."""
    small = [d for d in range(1, int(value**0.5) + 1) if value % d == 0]
    return small + [value // d for d in reversed(small) if d * d != value]
