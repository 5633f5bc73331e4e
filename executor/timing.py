"""Per-op compute timers and injected slowdowns (`--slow-device DEV:FACTOR@STEP`).

An op's time is the CPU time of the rank's thread while it runs (`time.thread_time`, torch held to
one thread): a wait inside a TP collective (gloo blocks the caller without spinning) or a
preemption by another process on a shared host is not this device's compute, so a slow GPU's TP
partner no longer looks slow too. A slowed device sleeps (factor - 1) x each op's compute after
the op and reports factor x it: what the same work takes on a GPU that much slower.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

_SLOWDOWN = re.compile(r"^(\d+:\d+):([0-9.]+)(?:@(\d+))?$")


@dataclass(frozen=True)
class Slowdown:
    device: str
    factor: float
    from_step: int = 0

    @classmethod
    def parse(cls, text: str) -> Slowdown:
        """`NODE:GPU:FACTOR[@STEP]`, e.g. `3:0:2.5@10`: device 3:0 runs 2.5x slower from step 10 on."""
        match = _SLOWDOWN.match(text.strip())
        if not match:
            raise ValueError(f"--slow-device {text!r}: expected NODE:GPU:FACTOR[@STEP], e.g. 3:0:2.5@10")
        factor = float(match.group(2))
        if not 1.0 <= factor <= 100.0:
            raise ValueError(f"--slow-device {text!r}: the factor must be in [1, 100]")
        return cls(match.group(1), factor, int(match.group(3) or 0))


def slow_factor(slowdowns: tuple[Slowdown, ...], device: str, step: int) -> float:
    """The factor a device runs at in `step` (the latest slowdown that has started wins)."""
    started = [s for s in slowdowns if s.device == device and s.from_step <= step]
    return max(started, key=lambda s: s.from_step).factor if started else 1.0


def _sleep_until(deadline: float) -> None:
    """Sleep, then spin the last 2 ms: a plain sleep on a busy host wakes up late, inflating the slowdown."""
    while (left := deadline - time.perf_counter()) > 0.002:
        time.sleep(left - 0.002)
    while time.perf_counter() < deadline:
        pass


# An op's share of a layer's work for one microbatch: forward 1, full backward 2, its input or weight half 1.
OP_WORK = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


class OpTimer:
    """Per-microbatch compute time of one rank; slowed by `slow_factor` (set per step).

    With `emulate_ms_per_layer` the rank behaves like a GPU instead of sharing the host's CPUs: an op
    lasts `emulate_ms_per_layer x layers x micro_batch_size x OP_WORK / tp x slow_factor` of wall time
    (it computes, then sleeps the rest; the real compute must be shorter) and reports that. Ranks
    then run side by side whatever the host's core count, as a cluster's GPUs do, so steps per second
    measure the schedule, the balance and the reconfiguration rather than CPU contention.
    """

    def __init__(self, slow_factor: float = 1.0, emulate_ms_per_layer: float | None = None):
        self.slow_factor = slow_factor
        self.emulate_ms_per_layer = emulate_ms_per_layer
        self.ms: dict[int, float] = defaultdict(float)
        self.after_op: Callable[[], None] | None = None  # called after each op (`--fail-device` dies there)

    @staticmethod
    def start() -> tuple[float, float]:
        return time.thread_time(), time.perf_counter()

    def record(self, microbatch: int, start: tuple[float, float], work_layers: float = 0.0) -> None:
        """`work_layers`: the op's work in layer-microbatches (layers x micro_batch_size x OP_WORK / tp)."""
        self._record(microbatch, start, work_layers)
        if self.after_op is not None:
            self.after_op()

    def _record(self, microbatch: int, start: tuple[float, float], work_layers: float) -> None:
        cpu_start, wall_start = start
        if self.emulate_ms_per_layer is not None:
            emulated_s = self.slow_factor * self.emulate_ms_per_layer * work_layers / 1000.0
            _sleep_until(wall_start + emulated_s)
            self.ms[microbatch] += emulated_s * 1000.0
            return
        compute_s = time.thread_time() - cpu_start
        if self.slow_factor > 1.0:
            _sleep_until(time.perf_counter() + (self.slow_factor - 1.0) * compute_s)
        self.ms[microbatch] += self.slow_factor * compute_s * 1000.0

    def wrap(self, fn: Callable, work_layers: Callable[[dict], float] = lambda kwargs: 0.0) -> Callable:
        def timed(microbatch: int, *args, **kwargs):
            start = self.start()
            result = fn(microbatch, *args, **kwargs)
            self.record(microbatch, start, work_layers(kwargs))
            return result

        return timed

    def take(self) -> dict[int, float]:
        ms, self.ms = dict(self.ms), defaultdict(float)
        return ms
