"""The solver pool on its own: answers, errors, saturation, crashes, the deadline backstop, cancellation.

Each test runs its own event loop (asyncio.run) and pool of real worker processes.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from api.execution import (
    CANCELLED,
    CRASHED,
    EXPIRED,
    OK,
    REJECTED,
    TIMED_OUT,
    DeadlineExpired,
    PoolConfig,
    PoolSaturated,
    SolverPool,
    TaskError,
    TaskTimedOut,
    WorkerCrashed,
)
from planner.errors import PlanningError
from tests.api import pool_tasks


class Recorder:
    def __init__(self) -> None:
        self.outcomes: list[tuple[str, str]] = []

    def task_finished(self, task, outcome, queued_s, ran_s, result) -> None:
        self.outcomes.append((task, outcome))


def run_with_pool(config: PoolConfig, scenario, observer=None):
    async def main():
        pool = SolverPool(config, observer)
        await pool.start()
        try:
            return await scenario(pool)
        finally:
            await pool.close()

    return asyncio.run(main())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child of the forkserver may linger as a zombie until reaped; /proc tells.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def _wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_results_and_task_errors_come_back_across_the_process_boundary():
    async def scenario(pool):
        assert await pool.run(pool_tasks.echo, {"a": [1, 2]}, deadline_s=10) == {"a": [1, 2]}
        worker_pid = await pool.run(pool_tasks.pid, deadline_s=10)
        assert worker_pid != os.getpid(), "the task ran in the server process"
        with pytest.raises(PlanningError, match="cannot fit"):
            await pool.run(pool_tasks.refuse, "cannot fit", deadline_s=10)
        with pytest.raises(TaskError, match="_Unpicklable: custom error") as raised:
            await pool.run(pool_tasks.raise_unpicklable, deadline_s=10)
        assert any("in the solver worker" in note for note in raised.value.__notes__)
        with pytest.raises(TaskError, match="could not be sent back"):
            await pool.run(pool_tasks.return_unpicklable, deadline_s=10)
        # None of these cost a worker: the same one is still serving.
        assert await pool.run(pool_tasks.pid, deadline_s=10) == worker_pid

    run_with_pool(PoolConfig(workers=1, queue_size=0), scenario)


@pytest.mark.parametrize("death", [pool_tasks.kill_self, pool_tasks.exit_abruptly], ids=["SIGKILL", "os._exit"])
def test_a_worker_dying_mid_task_fails_only_that_task(death):
    recorder = Recorder()

    async def scenario(pool):
        before = set(pool.worker_pids())
        survivor = asyncio.ensure_future(pool.run(pool_tasks.sleep_then, 1.0, "survived", deadline_s=30))
        await asyncio.sleep(0.1)  # the survivor is running on one worker
        with pytest.raises(WorkerCrashed) as crashed:
            await pool.run(death, 0.2, deadline_s=30)
        assert crashed.value.retry_after_s >= 1
        assert "stopped unexpectedly" in str(crashed.value)
        assert await survivor == "survived"
        # The dead worker was replaced; the pool serves at full strength again.
        await _wait_until(lambda: len(pool.worker_pids()) == 2)
        after = set(pool.worker_pids())
        assert len(before - after) == 1, "exactly the dead worker was replaced"
        results = await asyncio.gather(*(pool.run(pool_tasks.echo, n, deadline_s=10) for n in range(4)))
        assert results == [0, 1, 2, 3]

    run_with_pool(PoolConfig(workers=2, queue_size=2), scenario, recorder)
    assert (death.__name__, CRASHED) in recorder.outcomes
    assert ("sleep_then", OK) in recorder.outcomes


def test_a_saturated_pool_rejects_at_once_with_retry_after_and_recovers():
    recorder = Recorder()

    async def scenario(pool):
        running = [asyncio.ensure_future(pool.run(pool_tasks.sleep_then, 1.0, n, deadline_s=30)) for n in range(2)]
        await _wait_until(lambda: pool.stats().busy == 1 and pool.stats().queued == 1)
        started = time.monotonic()
        with pytest.raises(PoolSaturated) as rejected:
            await pool.run(pool_tasks.echo, "x", deadline_s=30)
        assert time.monotonic() - started < 0.1, "a full pool must answer at once, not queue"
        assert rejected.value.retry_after_s >= 1
        assert "1 solver workers are busy and 1 requests are waiting" in str(rejected.value)
        assert [await task for task in running] == [0, 1]
        assert await pool.run(pool_tasks.echo, "after", deadline_s=10) == "after"

    run_with_pool(PoolConfig(workers=1, queue_size=1), scenario, recorder)
    assert ("echo", REJECTED) in recorder.outcomes


def test_a_task_past_its_deadline_plus_grace_is_killed_and_its_worker_replaced():
    recorder = Recorder()

    async def scenario(pool):
        stuck_pid = (pool.worker_pids())[0]
        started = time.monotonic()
        with pytest.raises(TaskTimedOut) as timed_out:
            await pool.run(pool_tasks.sleep_then, 60.0, "never", deadline_s=0.5)
        elapsed_s = time.monotonic() - started
        assert 0.8 <= elapsed_s < 2.0, elapsed_s  # deadline 0.5 s + grace 0.3 s, not the task's 60 s
        assert timed_out.value.status_code == 504
        await _wait_until(lambda: not _alive(stuck_pid))
        assert await pool.run(pool_tasks.echo, "next", deadline_s=10) == "next"
        assert stuck_pid not in pool.worker_pids()

    run_with_pool(PoolConfig(workers=1, queue_size=0, grace_s=0.3), scenario, recorder)
    assert ("sleep_then", TIMED_OUT) in recorder.outcomes


def test_a_queued_task_whose_deadline_passes_is_dropped_before_it_runs():
    recorder = Recorder()

    async def scenario(pool):
        busy = asyncio.ensure_future(pool.run(pool_tasks.sleep_then, 1.5, "busy", deadline_s=30))
        await _wait_until(lambda: pool.stats().busy == 1)
        started = time.monotonic()
        with pytest.raises(DeadlineExpired) as expired:
            await pool.run(pool_tasks.echo, "late", deadline_s=0.3)
        assert time.monotonic() - started < 1.0
        assert expired.value.retry_after_s >= 1
        assert await busy == "busy"

    run_with_pool(PoolConfig(workers=1, queue_size=1), scenario, recorder)
    assert ("echo", EXPIRED) in recorder.outcomes


def test_cancelling_a_run_stops_its_worker_and_frees_the_slot():
    recorder = Recorder()

    async def scenario(pool):
        worker_pid = pool.worker_pids()[0]
        task = asyncio.ensure_future(pool.run(pool_tasks.sleep_then, 60.0, "never", deadline_s=120))
        await _wait_until(lambda: pool.stats().busy == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert pool.stats().busy == 0 and pool.stats().queued == 0
        await _wait_until(lambda: not _alive(worker_pid))
        assert await pool.run(pool_tasks.echo, "free", deadline_s=10) == "free"

    run_with_pool(PoolConfig(workers=1, queue_size=0), scenario, recorder)
    assert ("sleep_then", CANCELLED) in recorder.outcomes


def test_closing_the_pool_stops_every_worker():
    async def scenario(pool):
        return pool.worker_pids()

    pids = run_with_pool(PoolConfig(workers=2, queue_size=0), scenario)
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "workers outlived the pool"
        time.sleep(0.05)


def test_a_worker_that_died_while_idle_is_replaced_without_failing_a_task():
    async def scenario(pool):
        victim = pool.worker_pids()[0]
        os.kill(victim, 9)
        await _wait_until(lambda: not _alive(victim))
        assert await pool.run(pool_tasks.echo, "fine", deadline_s=10) == "fine"
        await _wait_until(lambda: len(pool.worker_pids()) == 1 and victim not in pool.worker_pids())

    run_with_pool(PoolConfig(workers=1, queue_size=0), scenario)
