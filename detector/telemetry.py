"""Telemetry the trainers report, one item per device per iteration (API.md `POST /v1/detect`).

`compute_ms` is the device's own compute time for one microbatch (forward and
backward kernels, e.g. timed with CUDA events around the layers), not time
spent blocked in a collective or waiting for a pipeline neighbour: a slow GPU
must not make its tensor-parallel peers look slow too.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class TelemetryError(ValueError):
    """Telemetry that cannot be judged against the plan (unknown device, negative time, duplicates); the
    service answers it 422 (api.tasks.detection)."""


@dataclass(frozen=True)
class Microbatch:
    """One packed microbatch: the length of every sequence in it and its compute time (ms)."""

    seq_lengths: tuple[int, ...]
    compute_ms: float

    def __post_init__(self) -> None:
        if not self.seq_lengths:
            raise TelemetryError("a microbatch needs at least one sequence length")
        if any(length < 1 for length in self.seq_lengths):
            raise TelemetryError(f"sequence lengths must be at least 1, got {min(self.seq_lengths)}")
        if not math.isfinite(self.compute_ms) or self.compute_ms < 0:
            raise TelemetryError(f"compute_ms must be a finite time >= 0, got {self.compute_ms}")

    @property
    def tokens(self) -> int:
        return sum(self.seq_lengths)

    @property
    def sum_squared_lengths(self) -> int:
        """Attention work grows with each packed sequence's length squared (document masking)."""
        return squared_lengths(self.seq_lengths)


def squared_lengths(seq_lengths: Sequence[int]) -> int:
    """sum(length ** 2), exact (Python ints), without a Python-level loop."""
    return sum(map(operator.mul, seq_lengths, seq_lengths))


@dataclass(frozen=True)
class TelemetryItem:
    """What one device reports for one iteration.

    microbatches may be empty: a device that stopped computing still reports
    (or is reported with) the age of its last heartbeat.
    """

    device: str
    iteration: int
    microbatches: tuple[Microbatch, ...]
    last_heartbeat_s_ago: float

    def __post_init__(self) -> None:
        if self.iteration < 0:
            raise TelemetryError(f"{self.device}: iteration must be >= 0, got {self.iteration}")
        if not math.isfinite(self.last_heartbeat_s_ago) or self.last_heartbeat_s_ago < 0:
            raise TelemetryError(
                f"{self.device}: last_heartbeat_s_ago must be a finite age >= 0 s, got {self.last_heartbeat_s_ago}"
            )

    @property
    def compute_ms(self) -> float:
        return sum(microbatch.compute_ms for microbatch in self.microbatches)

    @property
    def tokens(self) -> int:
        return sum(microbatch.tokens for microbatch in self.microbatches)

    @property
    def squared_lengths(self) -> int:
        return sum(microbatch.sum_squared_lengths for microbatch in self.microbatches)

    def totals(self) -> TelemetryTotals:
        return TelemetryTotals(
            device=self.device,
            iteration=self.iteration,
            microbatches=len(self.microbatches),
            compute_ms=self.compute_ms,
            tokens=self.tokens,
            squared_lengths=self.squared_lengths,
            last_heartbeat_s_ago=self.last_heartbeat_s_ago,
        )


@dataclass(frozen=True, slots=True)
class TelemetryTotals:
    """One telemetry item reduced to the sums the detector uses; a role's expected work is linear in
    `tokens` and `squared_lengths`, so the per-microbatch detail need not be kept. About 200 bytes
    whatever the item's size: 4,096 devices x 8 iterations of 60 MB of JSON keep 7 MB of these."""

    device: str
    iteration: int
    microbatches: int
    compute_ms: float  # summed over the microbatches
    tokens: int  # summed sequence lengths
    squared_lengths: int  # summed squared sequence lengths
    last_heartbeat_s_ago: float


class ItemTotals(Protocol):
    """What the detector reads of an item: a TelemetryItem or its TelemetryTotals."""

    @property
    def device(self) -> str: ...
    @property
    def iteration(self) -> int: ...
    @property
    def compute_ms(self) -> float: ...
    @property
    def tokens(self) -> int: ...
    @property
    def squared_lengths(self) -> int: ...
    @property
    def last_heartbeat_s_ago(self) -> float: ...
