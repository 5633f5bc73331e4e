"""Test-only tasks for the solver pool: module-level so worker processes can unpickle them."""

from __future__ import annotations

import os
import signal
import time

from planner.errors import PlanningError


def echo(value):
    return value


def pid() -> int:
    return os.getpid()


def sleep_then(seconds: float, value):
    time.sleep(seconds)
    return value


def exit_abruptly(after_s: float = 0.0, status: int = 3) -> None:
    """Die without cleanup, as a crash in native code would."""
    time.sleep(after_s)
    os._exit(status)


def kill_self(after_s: float = 0.0) -> None:
    """SIGKILL this worker, as the OOM killer would."""
    time.sleep(after_s)
    os.kill(os.getpid(), signal.SIGKILL)


def refuse(message: str) -> None:
    raise PlanningError(message)


class _Unpicklable(Exception):
    def __init__(self, first: str, second: str) -> None:
        super().__init__(f"{first} {second}")


def raise_unpicklable() -> None:
    raise _Unpicklable("custom", "error")


def return_unpicklable():
    return lambda: None


# Memory a task leaves behind, as Python's allocator keeps freed memory of a big parse: the worker's state
# outlives the task, which is what recycling is for.
_KEPT: list[bytes] = []


def keep_memory(mib: int, then_raise: bool = False) -> int:
    """Allocate `mib` MiB (written, so resident) and keep it; return the worker's pid (or raise)."""
    _KEPT.append(b"\x01" * (mib * 1024 * 1024))
    if then_raise:
        raise PlanningError(f"kept {mib} MiB, then failed")
    return os.getpid()
