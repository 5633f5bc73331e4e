"""A bounded pool of solver worker processes: solving never runs in the server's event loop.

    pool = SolverPool(PoolConfig(workers=4, queue_size=4, grace_s=5.0))
    await pool.start()
    plan = await pool.run(plan_for, request, deadline_s=10.0)   # a module-level, picklable function
    await pool.close()

Why not `concurrent.futures.ProcessPoolExecutor`: one dead worker (the OOM killer, a crash in native
solver code, a SIGKILL) marks the whole executor broken and fails every request in flight. Here every
worker is one process with its own pipe, so a death fails only the task it was running, and the
worker is replaced.

- Admission: at most `workers` tasks run and `queue_size` wait for a worker; beyond that `run` raises
  `PoolSaturated` at once (the API answers 503 with Retry-After) instead of letting latency grow.
- Deadline: a task still queued when its `deadline_s` has passed is dropped (`DeadlineExpired`); a task
  that has not answered `deadline_s + grace_s` after `run` was called has its worker killed and
  replaced (`TaskTimedOut`). Tasks that can trade quality for time (the planner) take their deadline as
  an argument and answer by it; the backstop is for those that do not.
- Warm workers: they fork from a forkserver that imported `warm_modules` (the planner, OR-Tools) once,
  so starting or replacing one costs a fork rather than a second of imports. A worker joins the pool only
  once it says it has imported them: `start` returns (and the service accepts requests) with every worker
  ready, so no request's deadline pays for the imports.
- Recycling: a worker whose resident memory is over `max_worker_rss_mib` after a task (Python's allocator
  keeps much of what a big parse or solve freed) delivers the answer, exits, and is replaced: an expected
  path, reported to the observer as `worker_recycled`, not a crash.
- Retry-After: from the backlog and recent run times per task kind (`api.core.backlog`).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import multiprocessing
import os
import pickle
import resource
import signal
import sys
import traceback
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol, TypeVar

from api.core.backlog import RunTimes, retry_after_s

log = logging.getLogger("resiplan.execution")

T = TypeVar("T")

# The worker tasks import the planner (OR-Tools, cost models), the detector, renderers and the wire schemas.
WARM_MODULES = ("api.tasks.planning", "api.tasks.detection", "api.tasks.replanning", "api.tasks.rendering")

# Outcomes reported to the observer, one per `run` call.
OK, ERROR, CRASHED, TIMED_OUT, REJECTED, EXPIRED, CANCELLED = (
    "ok", "error", "crashed", "timed_out", "rejected", "expired", "cancelled"
)

_RETRY_AFTER_CRASH_S = 1
_MAX_RETRY_AFTER_S = 60
_JOIN_TIMEOUT_S = 5.0
# A worker's first message: it has imported its modules and takes tasks.
_READY = b"ready"
_MIB = 1024 * 1024


class PoolError(Exception):
    """A task got no answer for a reason of the pool's, not of the task's; the API answers `status_code`."""

    status_code = 503

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class PoolSaturated(PoolError):
    """Every worker is busy and the queue is full."""


class DeadlineExpired(PoolError):
    """The task's deadline passed while it waited for a worker."""


class WorkerCrashed(PoolError):
    """The worker running the task died; it has been replaced."""


class TaskTimedOut(PoolError):
    """The task ran past its deadline plus the grace period; its worker was killed and replaced."""

    status_code = 504


class PoolClosed(PoolError):
    """The pool is shutting down."""


class WorkerStartFailed(RuntimeError):
    """A worker died or stayed silent while importing its modules: the pool cannot start (or replace) it."""


class TaskError(Exception):
    """A task raised something that cannot travel back between processes; the message and traceback can."""


@dataclass(frozen=True)
class PoolConfig:
    """workers: solver processes (each runs one task at a time). queue_size: tasks that may wait for a
    worker beyond those running. grace_s: seconds past a task's deadline before its worker is killed.
    start_method: `forkserver` (warm forks) or `spawn`. niceness: added to the workers' nice value.
    max_worker_rss_mib: a worker resident in more memory than this after a task is replaced (None: never).
    max_retry_after_s: the most Retry-After ever says. start_timeout_s: how long a starting worker may take to
    import its modules (the first, through the forkserver, imports them for all) before start fails."""

    workers: int
    queue_size: int
    grace_s: float = 10.0
    warm_modules: tuple[str, ...] = WARM_MODULES
    start_method: str = "forkserver"
    # Workers run at a lower CPU priority than the server, so health checks and admission answer at once
    # even when every core is solving; with nothing else to run, solves lose nothing.
    niceness: int = 5
    max_worker_rss_mib: float | None = None
    max_retry_after_s: int = _MAX_RETRY_AFTER_S
    start_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if (self.workers < 1 or self.queue_size < 0 or self.grace_s < 0 or self.max_retry_after_s < 1
                or self.start_timeout_s <= 0):
            raise ValueError(f"invalid pool config {self}")
        if self.max_worker_rss_mib is not None and self.max_worker_rss_mib <= 0:
            raise ValueError(f"invalid pool config {self}")


@dataclass(frozen=True)
class PoolStats:
    workers: int  # configured
    alive: int  # started and not being replaced
    busy: int  # running a task
    queued: int  # admitted, waiting for a worker
    capacity: int  # workers + queue_size: tasks admitted at once


class PoolObserver(Protocol):
    def task_finished(self, task: str, outcome: str, queued_s: float, ran_s: float, result: object) -> None:
        """Called once per `run`: the task's function name, one of the outcomes above, seconds spent waiting
        for a worker and running, and the task's return value (None unless the outcome is OK)."""

    def worker_recycled(self, task: str, resident_mib: float) -> None:
        """A worker finished `task` (its answer delivered) resident in `resident_mib`, over the limit, and
        was replaced."""


class _Worker:
    """The parent's handle on one worker process and its end of the pipe."""

    def __init__(self, process: multiprocessing.process.BaseProcess, conn: Connection) -> None:
        self.process = process
        self.conn = conn
        self.reaped = False

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the worker has imported its modules (its first message); raise WorkerStartFailed,
        having stopped it, if it dies or stays silent for `timeout_s`."""
        try:
            if self.conn.poll(timeout_s) and self.conn.recv_bytes() == _READY:
                return
            problem = f"sent nothing within {timeout_s:g} s"
        except (EOFError, OSError):
            self.process.join(_JOIN_TIMEOUT_S)
            problem = f"exited while starting ({_exit_text(self.process.exitcode)})"
        self.reap()
        raise WorkerStartFailed(f"a solver worker {problem}")

    def call(self, payload: bytes) -> tuple[str, Any, float | None]:
        """Send one task and wait for its reply (blocking: runs in a thread): (kind, value, the worker's
        resident MiB if it is retiring, else None). ("crashed", exitcode, None) if the process died, which
        closes the only other end of the pipe and ends the wait with EOF."""
        try:
            self.conn.send_bytes(payload)
            return pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            self.process.join(_JOIN_TIMEOUT_S)
            return ("crashed", self.process.exitcode, None)

    def kill(self) -> None:
        if not self.reaped and self.process.is_alive():
            self.process.kill()

    def terminate(self) -> None:
        try:
            if not self.reaped and self.process.is_alive():
                self.process.terminate()
        except ValueError:  # reaped by another thread meanwhile: its process object is closed
            pass

    def reap(self, exit_wait_s: float = 0.0) -> None:
        """Stop the process (if it still runs after `exit_wait_s`) and release its resources; blocking,
        idempotent."""
        if self.reaped:
            return
        self.reaped = True
        if exit_wait_s > 0:
            self.process.join(exit_wait_s)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(_JOIN_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
        self.process.join(_JOIN_TIMEOUT_S)
        self.conn.close()
        if self.process.exitcode is not None:
            self.process.close()


class SolverPool:
    """See the module docstring. Use from one event loop: `start`, any number of concurrent `run`s, `close`."""

    def __init__(self, config: PoolConfig, observer: PoolObserver | None = None) -> None:
        self.config = config
        self._observer = observer
        self._context = multiprocessing.get_context(config.start_method)
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._workers: set[_Worker] = set()
        self._replacing: set[asyncio.Task[None]] = set()
        self._calls: set[asyncio.Future[Any]] = set()
        # One thread per running task waits on its pipe; the event loop never blocks on a pipe.
        self._pipes = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="resiplan-solver-pipe")
        self._admitted = 0
        self._busy = 0
        self._backlog: Counter[str] = Counter()  # admitted tasks (running or queued) by kind
        # Recent run times per task kind, for Retry-After; operators and tests may record known times.
        self.run_times = RunTimes()
        # Workers started but not yet ready: not in `_workers` (no task goes to them), yet close() stops them.
        self._starting: set[_Worker] = set()
        self._started = False
        self._closed = False
        self._start_lock = asyncio.Lock()  # one start at a time: a second waits, then finds the pool started

    # -- lifecycle -----------------------------------------------------------------------------------------

    async def start(self) -> None:
        async with self._start_lock:
            if self._started:
                return
            if self.config.start_method == "forkserver":
                # Process-wide, and ignored if this process's forkserver already runs: then workers import
                # on their own (slower to start, same behaviour).
                self._context.set_forkserver_preload(list(self.config.warm_modules))
            # Started only once every worker is: a start that failed may be tried again.
            workers = await asyncio.to_thread(self._spawn_ready, self.config.workers)
            if self._closed:  # closed while they started: close() never saw them
                await asyncio.to_thread(_reap_all, workers)
                raise PoolClosed("the solver pool closed while it started", retry_after_s=_RETRY_AFTER_CRASH_S)
            self._started = True
            for worker in workers:
                self._workers.add(worker)
                self._idle.put_nowait(worker)

    async def close(self) -> None:
        """Stop every worker; tasks still running fail with PoolClosed."""
        self._closed = True
        workers = list(self._workers)
        for worker in [*workers, *self._starting]:  # a starting one's wait for its first message ends at once
            worker.terminate()
        if self._calls:
            await asyncio.wait(list(self._calls))  # the pipe threads see EOF; then no thread reads a pipe
        while self._replacing:
            await asyncio.gather(*list(self._replacing), return_exceptions=True)
        await asyncio.to_thread(_reap_all, workers)
        self._workers.clear()
        self._pipes.shutdown(wait=False, cancel_futures=True)

    # -- the entry point -----------------------------------------------------------------------------------

    async def run(self, fn: Callable[..., T], /, *args: Any, deadline_s: float) -> T:
        """`fn(*args)` in a worker process; its return value, or the exception it raised.

        `fn` must be a module-level function; `fn`, `args` and the result must pickle. Raises a
        `PoolError` when the pool cannot answer: saturated, deadline expired in the queue, worker crashed,
        worker killed past `deadline_s + grace_s`, pool closed.
        """
        name = getattr(fn, "__name__", "task")
        if self._closed or not self._started:
            raise PoolClosed("the solver pool is not running (the service is starting or stopping); retry",
                             retry_after_s=_RETRY_AFTER_CRASH_S)
        capacity = self.config.workers + self.config.queue_size
        if self._admitted >= capacity:
            self._observe(name, REJECTED, 0.0, 0.0, None)
            wait_s = self.retry_after_s()
            raise PoolSaturated(
                f"the planner is at capacity: all {self.config.workers} solver workers are busy and "
                f"{self.config.queue_size} requests are waiting; retry in {wait_s} s",
                retry_after_s=wait_s,
            )
        # Pickle here, not in the pipe thread, so an unpicklable argument fails in the caller's traceback.
        payload = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
        loop = asyncio.get_running_loop()
        called = loop.time()
        self._admitted += 1
        self._backlog[name] += 1
        try:
            try:
                worker = await asyncio.wait_for(self._idle_worker(), timeout=max(deadline_s, 0.0))
            except TimeoutError:
                waited_s = loop.time() - called
                self._observe(name, EXPIRED, waited_s, 0.0, None)
                self._leave_backlog(name)
                wait_s = self.retry_after_s()
                raise DeadlineExpired(
                    f"no solver worker became free within this request's deadline of {deadline_s:g} s; "
                    f"retry in {wait_s} s",
                    retry_after_s=wait_s,
                ) from None
            queued_s = loop.time() - called
            self._busy += 1
            try:
                return await self._execute(worker, name, payload, queued_s, called + deadline_s + self.config.grace_s)
            finally:
                self._busy -= 1
                self._leave_backlog(name)
        finally:
            self._admitted -= 1

    def stats(self) -> PoolStats:
        return PoolStats(
            workers=self.config.workers,
            alive=len(self._workers),
            busy=self._busy,
            queued=self._admitted - self._busy,
            capacity=self.config.workers + self.config.queue_size,
        )

    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (for operators and tests)."""
        return sorted(worker.pid for worker in self._workers if worker.pid is not None)

    def retry_after_s(self) -> int:
        """Seconds a rejected client should wait: until the workers have worked through the tasks admitted
        now, at their kinds' recent run times (`api.core.backlog`)."""
        return retry_after_s(self._backlog, self.config.workers, self.run_times, self.config.max_retry_after_s)

    # -- internals -----------------------------------------------------------------------------------------

    def _leave_backlog(self, name: str) -> None:
        self._backlog[name] -= 1
        if self._backlog[name] <= 0:
            del self._backlog[name]

    async def _idle_worker(self) -> _Worker:
        """The next idle worker that is still alive: one that died while idle (the OOM killer picks
        large processes) is replaced instead of failing the task handed to it."""
        while True:
            worker = await self._idle.get()
            if worker.process.is_alive():
                return worker
            log.error("solver worker %s died while idle (%s); replaced", worker.pid,
                      _exit_text(worker.process.exitcode))
            done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            self._replace(worker, done)

    async def _execute(self, worker: _Worker, name: str, payload: bytes, queued_s: float, backstop_at: float) -> Any:
        loop = asyncio.get_running_loop()
        started = loop.time()
        call = loop.run_in_executor(self._pipes, worker.call, payload)
        self._calls.add(call)
        call.add_done_callback(self._calls.discard)
        try:
            reply = await asyncio.wait_for(asyncio.shield(call), timeout=max(backstop_at - started, 0.0))
        except TimeoutError:
            worker.kill()  # ends the pipe wait at once (EOF)
            self._replace(worker, call)
            ran_s = loop.time() - started
            self.run_times.record(name, ran_s)  # it held its worker that long: so may the next one
            self._observe(name, TIMED_OUT, queued_s, ran_s, None)
            log.warning("solver task %s still running after %.1f s, past its deadline and grace; "
                        "worker %s killed and replaced", name, queued_s + ran_s, worker.pid)
            raise TaskTimedOut(
                f"the solver did not answer within this request's deadline plus {self.config.grace_s:g} s of grace "
                f"({queued_s + ran_s:.1f} s); it was stopped. Lower options.time_limit_s or retry later"
            ) from None
        except asyncio.CancelledError:
            # Nobody will read the answer (the client went away, the server is stopping): free the worker
            # now instead of holding it for the rest of the solve.
            worker.kill()
            self._replace(worker, call)
            self._observe(name, CANCELLED, queued_s, loop.time() - started, None)
            raise
        ran_s = loop.time() - started
        self.run_times.record(name, ran_s)
        kind, value, retiring_mib = reply
        if kind == "crashed":
            self._replace(worker, call)
            self._observe(name, CRASHED, queued_s, ran_s, None)
            if self._closed:
                raise PoolClosed("the service is shutting down; retry", retry_after_s=_RETRY_AFTER_CRASH_S)
            log.error("solver worker %s died running %s (%s); replaced", worker.pid, name, _exit_text(value))
            raise WorkerCrashed(
                f"the solver process working on this request stopped unexpectedly ({_exit_text(value)}); "
                "it has been replaced and other requests are unaffected; retry",
                retry_after_s=_RETRY_AFTER_CRASH_S,
            )
        if retiring_mib is None:
            self._idle.put_nowait(worker)
        else:
            self._recycle(worker, call, name, retiring_mib)
        if kind == "error":
            self._observe(name, ERROR, queued_s, ran_s, None)
            raise value
        self._observe(name, OK, queued_s, ran_s, value)
        return value

    def _spawn_ready(self, count: int) -> list[_Worker]:
        """Start `count` workers side by side and wait until each is ready (blocking: call in a thread). On any
        failure, or when the pool closes meanwhile, every worker it started is stopped before it raises."""
        workers: list[_Worker] = []
        try:
            for _ in range(count):
                workers.append(self._spawn())
                self._starting.add(workers[-1])
                # close() sets _closed before it stops what _starting holds: one of the two sees the other.
                if self._closed:
                    raise WorkerStartFailed("the solver pool closed while its workers started")
            for worker in workers:
                worker.wait_ready(self.config.start_timeout_s)
                if self._closed:
                    raise WorkerStartFailed("the solver pool closed while its workers started")
        except BaseException:
            _reap_all(workers)
            raise
        finally:
            self._starting.difference_update(workers)
        return workers

    def _spawn(self) -> _Worker:
        """Start one worker process, not waiting for it to be ready (blocking: call in a thread)."""
        parent_end, child_end = self._context.Pipe(duplex=True)
        max_rss_bytes = None if self.config.max_worker_rss_mib is None else int(self.config.max_worker_rss_mib * _MIB)
        process = self._context.Process(
            target=_worker_main, args=(child_end, self.config.warm_modules, self.config.niceness, max_rss_bytes),
            name="resiplan-solver", daemon=True,
        )
        process.start()
        # The child now holds the only other end: its death reads as EOF on parent_end.
        child_end.close()
        return _Worker(process, parent_end)

    def _recycle(self, worker: _Worker, pending: asyncio.Future[Any], name: str, resident_mib: float) -> None:
        log.info("solver worker %s is resident in %.0f MiB after %s, over the %g MiB limit; it exits and is "
                 "replaced", worker.pid, resident_mib, name, self.config.max_worker_rss_mib)
        self._replace(worker, pending, exit_wait_s=_JOIN_TIMEOUT_S)
        if self._observer is not None:
            try:
                self._observer.worker_recycled(name, resident_mib)
            except Exception:  # noqa: BLE001 - metrics must never fail a request
                log.exception("pool observer failed")

    def _replace(self, dead: _Worker, pending: asyncio.Future[Any], exit_wait_s: float = 0.0) -> None:
        """Replace `dead` once `pending` (its pipe call) is done; `exit_wait_s`: how long it may take to
        exit by itself (a recycled worker does) before it is terminated."""
        self._workers.discard(dead)
        if self._closed:
            return  # close() reaps every worker it found
        task = asyncio.get_running_loop().create_task(self._respawn(dead, pending, exit_wait_s))
        self._replacing.add(task)
        task.add_done_callback(self._replacing.discard)

    async def _respawn(self, dead: _Worker, pending: asyncio.Future[Any], exit_wait_s: float) -> None:
        # Close the dead worker's pipe only once no thread reads it any more: a closed descriptor
        # number is reused at once, by the replacement's pipe among others.
        await asyncio.wait([pending])
        await asyncio.to_thread(dead.reap, exit_wait_s)
        delay_s = 0.1
        while not self._closed:
            try:
                fresh, = await asyncio.to_thread(self._spawn_ready, 1)
            except Exception:  # noqa: BLE001 - keep trying; the pool runs with one worker fewer meanwhile
                if self._closed:
                    return  # close() stopped it while it started
                log.exception("could not start a replacement solver worker; retrying in %.1f s", delay_s)
                await asyncio.sleep(delay_s)
                delay_s = min(2 * delay_s, 5.0)
                continue
            if self._closed:
                await asyncio.to_thread(fresh.reap)
                return
            self._workers.add(fresh)
            self._idle.put_nowait(fresh)
            return

    def _observe(self, task: str, outcome: str, queued_s: float, ran_s: float, result: object) -> None:
        if self._observer is None:
            return
        try:
            self._observer.task_finished(task, outcome, queued_s, ran_s, result)
        except Exception:  # noqa: BLE001 - metrics must never fail a request
            log.exception("pool observer failed")


def _reap_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.reap()


def _exit_text(exitcode: int | None) -> str:
    if exitcode is None:
        return "exit status unknown"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit status {exitcode}"


# -- the worker process ------------------------------------------------------------------------------------


def _worker_main(conn: Connection, warm_modules: tuple[str, ...], niceness: int, max_rss_bytes: int | None) -> None:
    # Ctrl-C reaches the whole process group; the server decides when workers stop (it closes the pipe
    # or terminates them), so a worker must not die half-way through a reply on SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if niceness > 0:
        os.nice(niceness)
    for name in warm_modules:
        importlib.import_module(name)
    conn.send_bytes(_READY)
    while True:
        served = _serve_one(conn, max_rss_bytes)
        if served is None:
            return  # the server closed the pipe or is gone
        reply, retiring = served
        conn.send_bytes(reply)
        if retiring:
            return  # the server starts a fresh worker in its place


def _serve_one(conn: Connection, max_rss_bytes: int | None) -> tuple[bytes, bool] | None:
    """Receive one task and run it: the pickled reply (kind, value, resident MiB if retiring else None) and
    whether this worker retires; None once the pipe is closed. The wire form and the arguments are dropped
    as soon as they are done with (and a task error keeps no frames), so the resident size measured after
    the task is what the allocator kept, plus the answer."""
    try:
        payload = conn.recv_bytes()
    except (EOFError, OSError):
        return None
    try:
        fn, args = pickle.loads(payload)
        del payload  # a 60 MB /v1/detect body would otherwise be held twice while it is parsed
        outcome: tuple[str, Any] = ("ok", fn(*args))
    except Exception as error:  # noqa: BLE001 - every task error travels back to its caller
        outcome = ("error", _portable(error))
    fn = args = payload = None
    resident_bytes = _resident_bytes() if max_rss_bytes is not None else 0
    retiring = max_rss_bytes is not None and resident_bytes > max_rss_bytes
    return _dump_reply((*outcome, resident_bytes / _MIB if retiring else None)), retiring


def _resident_bytes() -> int:
    """This process's resident memory now (Linux), else its peak so far (what getrusage offers)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def _portable(error: Exception) -> Exception:
    """The exception itself if it survives pickling (its type is kept, e.g. PlanningError -> 422), else a
    TaskError with its text; either way with the worker's traceback as a note for the server's log."""
    error.add_note("in the solver worker:\n" + "".join(traceback.format_exception(error)).rstrip())
    # The note has the story; the frames (holding the task's arguments, a 60 MB body) need not live on.
    error.__traceback__ = error.__context__ = error.__cause__ = None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any pickling failure
        portable = TaskError(f"{type(error).__name__}: {error}")
        for note in getattr(error, "__notes__", ()):
            portable.add_note(note)
        return portable


def _dump_reply(reply: tuple[str, Any, float | None]) -> bytes:
    try:
        return pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as error:  # noqa: BLE001 - an unpicklable result is the task's error, not a crash
        return pickle.dumps(("error", TaskError(f"the task's result could not be sent back: {error}"), reply[2]))
