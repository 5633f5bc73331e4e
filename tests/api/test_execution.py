"""The solver pool on its own: answers, errors, saturation, crashes, the deadline backstop, cancellation.

Each test runs its own event loop (asyncio.run) and pool of real worker processes.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from api.core.execution import (
    CANCELLED,
    CRASHED,
    ERROR,
    EXPIRED,
    OK,
    REJECTED,
    TIMED_OUT,
    DeadlineExpired,
    PoolClosed,
    PoolConfig,
    PoolSaturated,
    SolverPool,
    TaskError,
    TaskTimedOut,
    WorkerCrashed,
    WorkerStartFailed,
)
from planner.errors import PlanningError
from tests.api import pool_tasks


class Recorder:
    def __init__(self) -> None:
        self.outcomes: list[tuple[str, str]] = []
        self.recycled: list[tuple[str, float]] = []

    def task_finished(self, task, outcome, queued_s, ran_s, result) -> None:
        self.outcomes.append((task, outcome))

    def worker_recycled(self, task, resident_mib) -> None:
        self.recycled.append((task, resident_mib))


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
    except (FileNotFoundError, ProcessLookupError):  # reaped between the two looks (reading /proc raises ESRCH)
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
        with pytest.raises(PoolSaturated) as rejected:
            await pool.run(pool_tasks.echo, "x", deadline_s=30)
        # Refused while both admitted tasks are still unfinished: the refusal waited for nothing.
        assert not any(task.done() for task in running), "a full pool must answer at once, not queue"
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
        with pytest.raises(TaskTimedOut) as timed_out:
            await pool.run(pool_tasks.sleep_then, 60.0, "never", deadline_s=0.5)
        # Killed, not waited for: had it run its 60 s the task would have answered "never".
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
        with pytest.raises(DeadlineExpired) as expired:
            await pool.run(pool_tasks.echo, "late", deadline_s=0.3)
        assert not busy.done(), "dropped while the worker was still busy: it never ran"
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


# -- recycling workers that grew ---------------------------------------------------------------------------

# A fresh worker (api.tasks.planning imported) is ~80 MiB resident; a task keeping 400 MiB puts it well over this.
_RSS_LIMIT_MIB = 300


@pytest.mark.parametrize("then_raise", [False, True], ids=["answer", "error"])
def test_a_worker_over_its_memory_limit_delivers_its_answer_then_is_replaced(then_raise):
    recorder = Recorder()

    async def scenario(pool):
        small = await pool.run(pool_tasks.pid, deadline_s=10)
        assert await pool.run(pool_tasks.pid, deadline_s=10) == small, "a worker under the limit was recycled"
        if then_raise:
            with pytest.raises(PlanningError, match="kept 400 MiB, then failed"):
                await pool.run(pool_tasks.keep_memory, 400, True, deadline_s=30)
            grown = small
        else:
            grown = await pool.run(pool_tasks.keep_memory, 400, deadline_s=30)
            assert grown == small
        # The next task runs in a fresh worker: the grown one exited on its own and was replaced.
        fresh = await pool.run(pool_tasks.pid, deadline_s=10)
        assert fresh != grown
        await _wait_until(lambda: not _alive(grown))
        assert pool.worker_pids() == [fresh]
        assert await pool.run(pool_tasks.pid, deadline_s=10) == fresh  # and it is kept: it is small

    run_with_pool(PoolConfig(workers=1, queue_size=0, max_worker_rss_mib=_RSS_LIMIT_MIB), scenario, recorder)
    assert [task for task, _ in recorder.recycled] == ["keep_memory"]
    assert recorder.recycled[0][1] > 400
    # An expected path: the task's own outcome, no crash.
    assert ("keep_memory", ERROR if then_raise else OK) in recorder.outcomes
    assert not any(outcome == CRASHED for _, outcome in recorder.outcomes)


def test_without_a_memory_limit_a_grown_worker_is_kept():
    async def scenario(pool):
        grown = await pool.run(pool_tasks.keep_memory, 400, deadline_s=30)
        assert await pool.run(pool_tasks.pid, deadline_s=10) == grown

    run_with_pool(PoolConfig(workers=1, queue_size=0), scenario)


# -- Retry-After from the backlog ------------------------------------------------------------------------------


def test_retry_after_grows_with_the_backlog_at_recent_run_times():
    async def scenario(pool):
        # Run times as if recent sleeps had taken 4 s each: the tasks below finish (and record their own)
        # only after the backlog has been read.
        for _ in range(3):
            pool.run_times.record("sleep_then", 4.0)
        assert pool.retry_after_s() == 1  # nothing admitted: retry at once
        first = asyncio.ensure_future(pool.run(pool_tasks.sleep_then, 1.0, "a", deadline_s=30))
        await _wait_until(lambda: pool.stats().busy == 1)
        assert pool.retry_after_s() == 2  # one running, 2 workers: 4 s / 2
        queued = [asyncio.ensure_future(pool.run(pool_tasks.sleep_then, 1.0, n, deadline_s=30)) for n in range(3)]
        await _wait_until(lambda: pool.stats().busy == 2 and pool.stats().queued == 2)
        assert pool.retry_after_s() == 8  # 4 admitted x 4 s / 2 workers
        pool.run_times.record("sleep_then", 12.0)  # slower recent runs: mean 6 s
        assert pool.retry_after_s() == 12
        with pytest.raises(PoolSaturated) as rejected:
            await pool.run(pool_tasks.echo, "x", deadline_s=30)
        assert rejected.value.retry_after_s == 12
        assert "retry in 12 s" in str(rejected.value)
        assert [await task for task in (first, *queued)] == ["a", 0, 1, 2]
        # What the tasks really took is recorded too: at least their sleep each.
        assert pool.run_times.typical_s("sleep_then") >= (3 * 4.0 + 12.0 + 4 * 1.0) / 8

    run_with_pool(PoolConfig(workers=2, queue_size=2), scenario)


def test_retry_after_counts_each_task_at_its_own_kinds_run_time():
    async def scenario(pool):
        pool.run_times.record("sleep_then", 10.0)
        pool.run_times.record("echo", 0.01)
        held = asyncio.ensure_future(pool.run(pool_tasks.sleep_then, 1.0, "held", deadline_s=30))
        await _wait_until(lambda: pool.stats().busy == 1)
        quick = [asyncio.ensure_future(pool.run(pool_tasks.echo, n, deadline_s=30)) for n in range(3)]
        await _wait_until(lambda: pool.stats().queued == 3)
        assert pool.retry_after_s() == 11  # 10 s + 3 x 0.01 s, rounded up; not 4 x (mean 5 s) = 20
        assert await held == "held" and [await task for task in quick] == [0, 1, 2]

    run_with_pool(PoolConfig(workers=1, queue_size=3), scenario)


def test_start_returns_once_every_worker_has_imported_its_modules(tmp_path, monkeypatch):
    # Each spawned worker imports the marker module itself; the import takes a second, then leaves a file.
    monkeypatch.setenv("RESIPLAN_TEST_MARKER_DIR", str(tmp_path))
    monkeypatch.setenv("RESIPLAN_TEST_IMPORT_DELAY_S", "1")
    config = PoolConfig(workers=2, queue_size=0, start_method="spawn",
                        warm_modules=("tests.api.slow_import_marker", "tests.api.pool_tasks"))

    async def scenario(pool):
        # No request can reach a worker still importing: every one has finished before start returned.
        assert sorted(int(marker.name) for marker in tmp_path.iterdir()) == pool.worker_pids()
        assert await pool.run(pool_tasks.echo, "ready", deadline_s=10) == "ready"

    run_with_pool(config, scenario)


def test_a_worker_that_cannot_import_its_modules_fails_start_saying_so():
    pool = SolverPool(PoolConfig(workers=2, queue_size=0, start_method="spawn",
                                 warm_modules=("tests.api.broken_import",)))

    async def scenario():
        with pytest.raises(WorkerStartFailed, match="exited while starting"):
            await pool.start()
        # Not started: a second try fails the same way, and a task is refused at once, not left to wait.
        with pytest.raises(WorkerStartFailed):
            await pool.start()
        with pytest.raises(PoolClosed):
            await pool.run(pool_tasks.echo, "x", deadline_s=10)

    asyncio.run(scenario())
    assert pool.stats().alive == 0 and not _solver_children()


def _solver_children() -> list:
    import multiprocessing

    return [child for child in multiprocessing.active_children() if child.name == "resiplan-solver"]


def test_workers_started_before_a_failing_start_are_stopped(monkeypatch):
    pool = SolverPool(PoolConfig(workers=3, queue_size=0, start_method="spawn", warm_modules=("tests.api.pool_tasks",)))
    spawn, started, pids = pool._spawn, [], []

    def spawn_twice():
        if len(started) == 2:
            raise OSError(11, "Resource temporarily unavailable")  # fork's EAGAIN on the third
        started.append(spawn())
        pids.append(started[-1].pid)
        return started[-1]

    monkeypatch.setattr(pool, "_spawn", spawn_twice)
    with pytest.raises(OSError):
        asyncio.run(pool.start())
    assert len(started) == 2 and all(worker.reaped for worker in started)
    assert not any(_alive(pid) for pid in pids) and not _solver_children()


def _marking_pool(tmp_path, monkeypatch) -> SolverPool:
    """One spawned worker that leaves its marker in tmp_path once it has imported: at once (`_crash`: slowly)."""
    monkeypatch.setenv("RESIPLAN_TEST_MARKER_DIR", str(tmp_path))
    monkeypatch.setenv("RESIPLAN_TEST_IMPORT_DELAY_S", "0")
    return SolverPool(PoolConfig(workers=1, queue_size=0, start_method="spawn",
                                 warm_modules=("tests.api.slow_import_marker", "tests.api.pool_tasks")))


async def _crash(pool: SolverPool, monkeypatch) -> None:
    """Kill the worker; its replacement imports for a minute."""
    monkeypatch.setenv("RESIPLAN_TEST_IMPORT_DELAY_S", "60")
    with pytest.raises(WorkerCrashed):
        await pool.run(pool_tasks.exit_abruptly, deadline_s=10)


def test_close_stops_a_replacement_still_importing(tmp_path, monkeypatch):
    async def scenario():
        pool = _marking_pool(tmp_path, monkeypatch)
        await pool.start()
        first = pool.worker_pids()
        await _crash(pool, monkeypatch)
        await _wait_until(lambda: any(child.pid not in first for child in _solver_children()))
        await pool.close()
        return first

    first = asyncio.run(scenario())
    # close() stopped the replacement mid-import (it never left its marker) and left no process behind.
    assert sorted(int(marker.name) for marker in tmp_path.iterdir()) == first
    assert not _solver_children()


def test_two_starts_at_once_start_the_workers_once():
    async def scenario():
        pool = SolverPool(PoolConfig(workers=2, queue_size=0, start_method="spawn", warm_modules=("tests.api.pool_tasks",)))
        await asyncio.gather(pool.start(), pool.start())
        try:
            return pool.stats().alive, len(_solver_children())
        finally:
            await pool.close()

    assert asyncio.run(scenario()) == (2, 2)


def test_close_stops_a_replacement_caught_while_its_process_is_created(tmp_path, monkeypatch):
    import threading

    async def scenario():
        pool = _marking_pool(tmp_path, monkeypatch)
        await pool.start()
        first = pool.worker_pids()
        entered, release, spawn = threading.Event(), threading.Event(), pool._spawn

        def held_spawn():  # the replacement's process is created only once close() has begun
            entered.set()
            release.wait(30)
            return spawn()

        monkeypatch.setattr(pool, "_spawn", held_spawn)
        await _crash(pool, monkeypatch)
        await _wait_until(entered.is_set)
        closing = asyncio.ensure_future(pool.close())
        await _wait_until(lambda: pool._closed)
        release.set()
        await closing
        return first

    first = asyncio.run(scenario())
    assert sorted(int(marker.name) for marker in tmp_path.iterdir()) == first
    assert not _solver_children()
