"""Prometheus metrics of one app instance (its own registry, never the process-global default one)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

from api.core.execution import PoolStats
from api.tasks.planning import PlanAnswer
from wire.schemas import Plan

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_SOLVE_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    """HTTP requests and latency (by route template, so plan ids do not explode the label space), solver
    tasks (run time, queue wait, outcome), plans by solver status, and the pool's gauges read at scrape."""

    def __init__(self, pool_stats: Callable[[], PoolStats | None]) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter("resiplan_http_requests", "HTTP requests answered.",
                                ["method", "route", "status"], registry=registry)
        self.latency = Histogram("resiplan_http_request_duration_seconds", "Time to answer an HTTP request.",
                                 ["method", "route"], buckets=_LATENCY_BUCKETS_S, registry=registry)
        self.in_progress = Gauge("resiplan_http_requests_in_progress", "HTTP requests being answered.",
                                 registry=registry)
        self.solve_time = Histogram("resiplan_solve_duration_seconds", "Time a task ran in a solver worker.",
                                    ["task"], buckets=_SOLVE_BUCKETS_S, registry=registry)
        self.queue_wait = Histogram("resiplan_solve_queue_wait_seconds", "Time a task waited for a solver worker.",
                                    ["task"], buckets=_LATENCY_BUCKETS_S, registry=registry)
        self.tasks = Counter("resiplan_solver_tasks", "Solver pool tasks by outcome: ok, error (the task "
                             "raised, e.g. an infeasible request), crashed, timed_out, rejected (pool full: 503), "
                             "expired (deadline passed in the queue), cancelled.",
                             ["task", "outcome"], registry=registry)
        self.workers_recycled = Counter("resiplan_solver_workers_recycled", "Solver workers replaced after a "
                                        "task because they were resident in more than the memory limit "
                                        "(RESIPLAN_SOLVER_WORKER_MAX_RSS_MIB); the task's answer was delivered.",
                                        ["task"], registry=registry)
        self.solver_status = Counter("resiplan_solver_status", "Plans answered, by the solver's status "
                                     "(OPTIMAL, FEASIBLE, ...).", ["status"], registry=registry)
        registry.register(_PoolCollector(pool_stats))

    def observe_request(self, method: str, route: str, status: int, duration_s: float) -> None:
        self.requests.labels(method, route, str(status)).inc()
        self.latency.labels(method, route).observe(duration_s)

    def task_finished(self, task: str, outcome: str, queued_s: float, ran_s: float, result: object) -> None:
        """api.core.execution.PoolObserver."""
        self.tasks.labels(task, outcome).inc()
        self.queue_wait.labels(task).observe(queued_s)
        if ran_s > 0:
            self.solve_time.labels(task).observe(ran_s)
        if isinstance(result, PlanAnswer):
            self.solver_status.labels(result.solver_status).inc()
        elif isinstance(result, Plan):
            self.solver_status.labels(result.solver.status).inc()

    def worker_recycled(self, task: str, resident_mib: float) -> None:
        """api.core.execution.PoolObserver."""
        self.workers_recycled.labels(task).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PoolCollector(Collector):
    def __init__(self, pool_stats: Callable[[], PoolStats | None]) -> None:
        self._pool_stats = pool_stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self._pool_stats()
        if stats is None:  # before startup / after shutdown
            return
        yield GaugeMetricFamily("resiplan_solver_queue_depth", "Requests waiting for a solver worker.",
                                value=stats.queued)
        yield GaugeMetricFamily("resiplan_solver_workers_busy", "Solver workers running a task.", value=stats.busy)
        yield GaugeMetricFamily("resiplan_solver_workers", "Solver worker processes alive.", value=stats.alive)
        yield GaugeMetricFamily("resiplan_solver_capacity", "Tasks admitted at once (workers + queue); "
                                "beyond it requests get 503.", value=stats.capacity)
