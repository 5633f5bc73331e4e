"""Operations, per-stage operation times and schedules as frozen data."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum


class OpKind(StrEnum):
    """What one op of a schedule computes; the letter is its label's first character (`F3`, `I3.1`)."""

    FORWARD = "F"
    BACKWARD = "B"  # full backward: input and weight gradients together
    INPUT_GRAD = "I"  # backward for the activations' gradient only (zero-bubble B)
    WEIGHT_GRAD = "W"  # the deferred weight-gradient half


FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD = OpKind
OP_KINDS = tuple(OpKind)
_GIB_UNITS = 1_000_000  # memory units per GiB when a stage's chunks hold different activations


def op_kinds(split_backward: bool) -> tuple[str, ...]:
    """The kinds of op a schedule runs: F, I and W with split backwards, F and B with full ones."""
    return (FORWARD, INPUT_GRAD, WEIGHT_GRAD) if split_backward else (FORWARD, BACKWARD)


class ScheduleError(ValueError):
    """A schedule that cannot run: a missing or repeated op, a broken dependency, a deadlock."""


@dataclass(frozen=True, order=True)
class Op:
    """One operation of one microbatch on one model chunk of a stage."""

    kind: str
    microbatch: int
    chunk: int = 0  # which of the stage's v model chunks (interleaved schedules)

    def label(self) -> str:
        """`F3`, or `F3.1` for chunk 1 of an interleaved stage."""
        suffix = f".{self.chunk}" if self.chunk else ""
        return f"{self.kind}{self.microbatch}{suffix}"


def parse_op(label: str) -> Op:
    """Inverse of `Op.label`."""
    kind, rest = label[:1], label[1:]
    if kind not in OP_KINDS or not rest:
        raise ScheduleError(f"bad operation {label!r}: expected F, B, I or W followed by a microbatch number")
    microbatch, _, chunk = rest.partition(".")
    try:
        return Op(kind, int(microbatch), int(chunk) if chunk else 0)
    except ValueError:
        raise ScheduleError(f"bad operation {label!r}: microbatch and chunk must be integers") from None


@dataclass(frozen=True)
class ChunkShare:
    """One model chunk's share of its stage's forward time, backward time and activations, where a stage's
    chunks are uneven (`layers_per_chunk`); chunks cut evenly take 1/v of each."""

    forward: float
    backward: float
    activation: float


@dataclass(frozen=True)
class ChunkTimes:
    """Per-microbatch times of one model chunk on one stage, at the stage's speed.

    `input_grad_ms + weight_grad_ms` is the full backward. `activation_gib`
    is what one microbatch's activations occupy from its forward until its
    last backward op (B, or W when split) finishes.
    """

    forward_ms: float
    input_grad_ms: float
    weight_grad_ms: float
    activation_gib: float = 0.0

    @property
    def backward_ms(self) -> float:
        return self.input_grad_ms + self.weight_grad_ms

    def duration_ms(self, kind: str) -> float:
        if kind == FORWARD:
            return self.forward_ms
        if kind == BACKWARD:
            return self.backward_ms
        if kind == INPUT_GRAD:
            return self.input_grad_ms
        return self.weight_grad_ms


@dataclass(frozen=True)
class GradSync:
    """One stage's data-parallel gradient sync (`planner.schedules.sync`)."""

    full_ms: float  # all its gradients' reduction over the data-parallel group
    last_bucket_ms: float  # the least of it that stays exposed (the whole reduction when it does not overlap)
    exposed_ms: float  # what the 1F1B overlap model charges, weight all-gather included: the plan's price before its schedule is known
    gather_exposed_ms: float = 0.0  # ZeRO-1's weight all-gather left exposed (at the iteration's start, whatever the schedule)


@dataclass(frozen=True)
class PipelineSpec:
    """What a schedule runs on: one replica's stages, microbatches and links.

    `chunks[s][c]` are the times of chunk c on physical stage s; every stage
    has `virtual_stages` chunks. Chunk c of stage s is virtual stage
    c * stages + s (Megatron's and PyTorch's looped placement), so a
    microbatch's forward visits stage 0..p-1 for chunk 0, then again for
    chunk 1, and so on. `p2p_latency_ms` separates an op from the dependent
    op on another stage. `activation_limit_gib[s]`, when given, caps the
    activations stage s may hold at once; `grad_sync[s]`, when given, is
    stage s's gradient sync, which schedules may hide differently.
    """

    chunks: tuple[tuple[ChunkTimes, ...], ...]
    num_microbatches: int
    p2p_latency_ms: float = 0.0
    activation_limit_gib: tuple[float, ...] | None = None
    grad_sync: tuple[GradSync, ...] | None = None  # per stage, when the replica's sync is known

    @property
    def num_stages(self) -> int:
        return len(self.chunks)

    @property
    def virtual_stages(self) -> int:
        return len(self.chunks[0])

    @property
    def hop_latency_ms(self) -> float:
        """Latency between consecutive virtual stages: `p2p_latency_ms`, or 0 when one stage holds them all."""
        return self.p2p_latency_ms if self.num_stages > 1 else 0.0

    def times(self, stage: int, op: Op) -> float:
        return self.chunks[stage][op.chunk].duration_ms(op.kind)

    def virtual_stage(self, stage: int, chunk: int) -> int:
        return chunk * self.num_stages + stage

    def physical(self, virtual_stage: int) -> tuple[int, int]:
        """(stage, chunk) holding a virtual stage."""
        return virtual_stage % self.num_stages, virtual_stage // self.num_stages

    def memory_units(self, stage: int) -> tuple[list[int], int] | None:
        """Integer demand per chunk and capacity of a stage's activation cap, conservative; None if uncapped."""
        if self.activation_limit_gib is None:
            return None
        cap = self.activation_limit_gib[stage]
        sizes = [t.activation_gib for t in self.chunks[stage]]
        if all(size <= 0 for size in sizes):
            return None
        if all(abs(size - sizes[0]) <= 1e-12 for size in sizes):
            return [1] * len(sizes), math.floor(cap / sizes[0] + 1e-9)
        demands = [max(0, math.ceil(size * _GIB_UNITS - 1e-6)) for size in sizes]
        return demands, math.floor(cap * _GIB_UNITS + 1e-6)


@dataclass(frozen=True)
class Schedule:
    """A named per-stage operation order for one replica."""

    name: str
    orders: tuple[tuple[Op, ...], ...]

    @property
    def splits_backward(self) -> bool:
        return any(op.kind == INPUT_GRAD for order in self.orders for op in order)

    @property
    def op_count(self) -> int:
        """Ops over every stage: what simulating the order costs, in units of work."""
        return sum(map(len, self.orders))


@dataclass(frozen=True)
class TimedOp:
    op: Op
    start_ms: float
    end_ms: float
