"""The service under load, on loopback: concurrent plan requests of mixed sizes plus /healthz probes.

    python -m benchmarks.load                      # 48 plan requests, all sent at once; print the table
    python -m benchmarks.load --write              # also update BENCHMARKS.md
    python -m benchmarks.load --requests 12 --quick

Starts the real service (`python -m cli serve`, its own database in a temporary directory) in a
subprocess, then sends every plan request at once. A request refused with 503 (pool full) is sent
again after the `Retry-After` the server named, as `adapters.client` does; each request gives up after
`--max-attempts` and the whole run after `--timeout` seconds. Meanwhile /healthz is probed every
`--probe-interval-ms`. Checked, not just measured:

- every request was answered 200 exactly once: one 200 per request on the client side, one request log
  line with that attempt's X-Request-ID in the server's JSON log, distinct plan ids, each readable with
  GET /v1/plans/{id} and equal to what the POST returned, and the store holds exactly that many plans;
- no 5xx other than 503, and the solver pool reports no crash, timeout or expiry.

"Saturated" health probes are those sent while at least as many plan requests were inside the server
as it has solver workers (so every worker was busy solving).

Then (unless `--fetch-seconds 0`) the same server estimates the largest plan the limits allow (`LARGEST_PLAN`:
65,536 sequences through an 8-stage pipeline on one node, tens of MB of timelines; an estimate is a stored
plan like any other) and `--fetch-clients` clients GET it over and over
for `--fetch-seconds`, while /healthz is probed again: a stored plan is served as the text the store holds,
so the event loop never parses or serializes it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "api" / "examples"
HEALTH_TARGET_MS = 100.0


def _example(name: str, time_limit_s: float) -> dict:
    body = json.loads((EXAMPLES / f"{name}.json").read_text())
    body["options"] = {**body.get("options", {}), "time_limit_s": time_limit_s}
    return body


def request_mix(time_limit_s: float) -> list[tuple[str, dict]]:
    """Sizes from 16 to 4,096 GPUs, healthy and damaged; cycled through in this order."""
    return [
        ("16 x A100 llama2-7b", {
            "cluster": {"num_nodes": 2, "gpus_per_node": 8, "gpu": "A100-80GB"}, "model": "llama2-7b",
            "failures": {"failed": ["1:3"]},
            "training": {"global_batch_size": 32, "seq_length": 2048}, "options": {"time_limit_s": time_limit_s}}),
        ("32 x A100 llama2-7b", _example("healthy-32xa100-llama2-7b", time_limit_s)),
        ("64 x H100 llama3-8b, slow", _example("slow-64xh100-llama3-8b", time_limit_s)),
        ("256 x A100 llama2-13b, failed", _example("one-failed-256xa100-llama2-13b", time_limit_s)),
        ("256 x A100 qwen2.5-32b, mixed", _example("mixed-256xa100-qwen2.5-32b", time_limit_s)),
        ("4,096 x H100 llama3-405b, failed+slow", {
            "cluster": {"num_nodes": 512, "gpus_per_node": 8, "gpu": "H100-SXM"}, "model": "llama3-405b",
            "failures": {"failed": ["9:0", "300:*"], "slow": [{"device": "100:4", "speed": 0.7}]},
            "training": {"global_batch_size": 2048, "seq_length": 8192}, "options": {"time_limit_s": time_limit_s}}),
    ]


@dataclass
class Outcome:
    index: int
    size: str
    attempts: int = 0
    rejected: int = 0  # 503 answers
    statuses: list[int] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    latency_s: float | None = None  # first send to the 200, retries included
    solve_attempt_s: float | None = None  # the successful attempt alone
    plan: dict | None = None


@dataclass
class Probe:
    sent_s: float
    latency_s: float | None  # None: failed
    plans_in_server: int


# The largest answer the limits admit: every microbatch is an op of every stage's timeline, so 65,536
# sequences (the most a request may ask for) of one microbatch each through an 8-stage pipeline.
LARGEST_PLAN = {
    "cluster": {"num_nodes": 1, "gpus_per_node": 8, "gpu": "A100-80GB"}, "model": "llama2-7b",
    "training": {"global_batch_size": 65_536, "seq_length": 2048}, "options": {"time_limit_s": 30},
    "layout": {"tp": 1, "pp": 8, "micro_batch_size": 1, "schedule": "1f1b", "recompute": "none"},
}


@dataclass
class Fetches:
    """Phase two: clients fetching one large stored plan over and over, and the health probes meanwhile."""

    plan_bytes: int
    clients: int
    latencies_s: list[float]
    failures: int
    probes: list[Probe]
    wall_s: float


@dataclass
class Run:
    workers: int
    queue_size: int
    outcomes: list[Outcome]
    probes: list[Probe]
    wall_s: float
    metrics_text: str
    log_lines: list[dict]
    stored_plans: int
    fetches: Fetches | None = None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(workdir: Path, workers: int, queue_size: int | None) -> tuple[subprocess.Popen, str, Path]:
    port = _free_port()
    log_path = workdir / "server.log"
    env = {**os.environ, "RESIPLAN_DATABASE_URL": f"sqlite:///{workdir / 'load.db'}",
           "RESIPLAN_SOLVER_WORKERS": str(workers)}
    env.pop("RESIPLAN_API_TOKEN", None)
    if queue_size is not None:
        env["RESIPLAN_SOLVER_QUEUE_SIZE"] = str(queue_size)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}; see {log_path}")
        try:
            if httpx.get(f"{base_url}/healthz", timeout=1).status_code == 200:
                return process, base_url, log_path
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    stop_server(process)
    raise RuntimeError("the server did not start within 60 s")


def stop_server(process: subprocess.Popen) -> None:
    """SIGTERM the server's process group (it, its forkserver and solver workers); SIGKILL what lingers."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    except ProcessLookupError:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # workers that outlived the server, if any
    except ProcessLookupError:
        pass


async def _plan_client(http: httpx.AsyncClient, base_url: str, outcome: Outcome, body: dict, max_attempts: int,
                       in_server, started_at: float) -> None:
    while outcome.attempts < max_attempts:
        outcome.attempts += 1
        request_id = f"load-{outcome.index}-{outcome.attempts}"
        outcome.request_ids.append(request_id)
        sent = time.monotonic()
        with in_server.get_lock():
            in_server.value += 1
        try:
            response = await http.post(f"{base_url}/v1/plan", json=body, headers={"X-Request-ID": request_id})
        finally:
            with in_server.get_lock():
                in_server.value -= 1
        outcome.statuses.append(response.status_code)
        if response.status_code == 503:
            outcome.rejected += 1
            await asyncio.sleep(min(float(response.headers.get("retry-after", "1")), 10.0))
            continue
        if response.status_code == 200:
            outcome.plan = response.json()
            outcome.solve_attempt_s = time.monotonic() - sent
            outcome.latency_s = time.monotonic() - started_at
        return


def _probe_loop(base_url: str, interval_s: float, stop, in_server, conn) -> None:
    """/healthz every `interval_s` until `stop` is set; sends back the probes. Runs in its own process so
    the load generator's own work (parsing plans) does not delay, and so inflate, the probes' latency."""
    probes: list[Probe] = []
    origin = time.monotonic()
    with httpx.Client(timeout=httpx.Timeout(10.0)) as http:
        while not stop.is_set():
            sent = time.monotonic()
            busy = in_server.value
            try:
                response = http.get(f"{base_url}/healthz")
                latency = time.monotonic() - sent if response.status_code == 200 else None
            except httpx.HTTPError:
                latency = None
            probes.append(Probe(sent - origin, latency, busy))
            stop.wait(max(0.0, interval_s - (time.monotonic() - sent)))
    conn.send(probes)
    conn.close()


async def drive(base_url: str, bodies: list[tuple[str, dict]], max_attempts: int, in_server,
                timeout_s: float) -> tuple[list[Outcome], float]:
    outcomes = [Outcome(index, size) for index, (size, _) in enumerate(bodies)]
    limits = httpx.Limits(max_connections=len(bodies) + 8, max_keepalive_connections=len(bodies) + 8)
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
        origin = time.monotonic()
        clients = [_plan_client(http, base_url, outcome, body, max_attempts, in_server, origin)
                   for outcome, (_, body) in zip(outcomes, bodies, strict=True)]
        await asyncio.wait_for(asyncio.gather(*clients), timeout=timeout_s)
        wall_s = time.monotonic() - origin
        # Read every plan back: it was stored once, under the id the POST returned.
        for outcome in outcomes:
            if outcome.plan is not None:
                stored = await http.get(f"{base_url}/v1/plans/{outcome.plan['plan_id']}")
                if stored.status_code != 200 or stored.json() != outcome.plan:
                    raise AssertionError(f"request {outcome.index}: stored plan differs from the answer")
    return outcomes, wall_s


def with_probes(base_url: str, probe_interval_s: float, load, in_server_start: int = 0):
    """Run `load(in_server)` (a coroutine function) while a prober process hits /healthz; (its result,
    the probes). `in_server` is the shared count of requests inside the server the probes are labelled with."""
    context = multiprocessing.get_context("spawn")
    in_server = context.Value("i", in_server_start)
    stop = context.Event()
    receiver, sender = context.Pipe(duplex=False)
    prober = context.Process(target=_probe_loop, args=(base_url, probe_interval_s, stop, in_server, sender),
                             name="resiplan-load-prober", daemon=True)
    prober.start()
    try:
        result = asyncio.run(load(in_server))
    finally:
        stop.set()
        probes = receiver.recv() if receiver.poll(30) else []
        prober.join(timeout=30)
    return result, probes


def drive_with_probes(base_url: str, bodies: list[tuple[str, dict]], max_attempts: int, probe_interval_s: float,
                      timeout_s: float) -> tuple[list[Outcome], list[Probe], float]:
    # in_server: plan requests sent and not yet answered.
    (outcomes, wall_s), probes = with_probes(
        base_url, probe_interval_s, lambda in_server: drive(base_url, bodies, max_attempts, in_server, timeout_s))
    return outcomes, probes, wall_s


async def _fetch_client(http: httpx.AsyncClient, url: str, until: float, latencies: list[float],
                        failures: list[int], expected_bytes: int) -> None:
    while time.monotonic() < until:
        sent = time.monotonic()
        try:
            response = await http.get(url)
            ok = response.status_code == 200 and len(response.content) == expected_bytes
        except httpx.HTTPError:
            ok = False
        if ok:
            latencies.append(time.monotonic() - sent)
        else:
            failures.append(1)


async def _fetch_for(url: str, clients: int, seconds: float, expected_bytes: int) -> tuple[list[float], int, float]:
    latencies: list[float] = []
    failures: list[int] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as http:
        started = time.monotonic()
        await asyncio.gather(*(_fetch_client(http, url, started + seconds, latencies, failures, expected_bytes)
                               for _ in range(clients)))
        return latencies, len(failures), time.monotonic() - started


def fetch_largest_plan(base_url: str, clients: int, seconds: float, probe_interval_s: float) -> Fetches:
    """Plan LARGEST_PLAN, then `clients` concurrent GETs of it for `seconds`, health probes alongside."""
    created = httpx.post(f"{base_url}/v1/estimate", json=LARGEST_PLAN, timeout=600)
    if created.status_code != 200:
        raise RuntimeError(f"the largest plan was not planned: {created.status_code} {created.text[:300]}")
    url = f"{base_url}/v1/plans/{created.json()['plan_id']}"
    expected_bytes = len(httpx.get(url, timeout=120).content)
    # Every probe is labelled as sent under the fetch load (`clients` requests inside the server).
    (latencies, failures, wall_s), probes = with_probes(
        base_url, probe_interval_s, lambda _in_server: _fetch_for(url, clients, seconds, expected_bytes), clients)
    return Fetches(expected_bytes, clients, latencies, failures, probes, wall_s)


def run(requests: int, workers: int, queue_size: int | None, time_limit_s: float, max_attempts: int,
        probe_interval_s: float, timeout_s: float, fetch_clients: int = 0, fetch_seconds: float = 0.0) -> Run:
    mix = request_mix(time_limit_s)
    bodies = [mix[index % len(mix)] for index in range(requests)]
    with tempfile.TemporaryDirectory(prefix="resiplan-load-") as tmp:
        workdir = Path(tmp)
        process, base_url, log_path = start_server(workdir, workers, queue_size)
        fetches = None
        try:
            outcomes, probes, wall_s = drive_with_probes(base_url, bodies, max_attempts, probe_interval_s, timeout_s)
            if fetch_clients and fetch_seconds > 0:
                fetches = fetch_largest_plan(base_url, fetch_clients, fetch_seconds, probe_interval_s)
            metrics_text = httpx.get(f"{base_url}/metrics", timeout=10).text
        finally:
            stop_server(process)
        log_lines = []
        for line in log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                log_lines.append(json.loads(line))
        with sqlite3.connect(workdir / "load.db") as db:
            stored_plans = db.execute("select count(*) from plans").fetchone()[0]
    stored_plans -= 1 if fetches is not None else 0  # the largest plan is not one of the requests
    return Run(workers, workers if queue_size is None else queue_size, outcomes, probes, wall_s, metrics_text,
               log_lines, stored_plans, fetches)


def check(result: Run) -> list[str]:
    """Every way a request could have been lost or answered twice; empty when none happened."""
    problems = []
    answered = [o for o in result.outcomes if o.plan is not None]
    for outcome in result.outcomes:
        if outcome.statuses.count(200) != 1:
            problems.append(f"request {outcome.index} ({outcome.size}): statuses {outcome.statuses}")
        if any(status != 200 and status != 503 for status in outcome.statuses):
            problems.append(f"request {outcome.index}: unexpected status in {outcome.statuses}")
    plan_ids = [o.plan["plan_id"] for o in answered]
    if len(set(plan_ids)) != len(plan_ids):
        problems.append("a plan id was returned twice")
    if result.stored_plans != len(result.outcomes):
        problems.append(f"the store holds {result.stored_plans} plans for {len(result.outcomes)} requests")
    served = Counter(line.get("request_id") for line in result.log_lines
                     if line.get("event") == "request" and line.get("route") == "/v1/plan" and line.get("status") == 200)
    for outcome in answered:
        final_id = outcome.request_ids[-1]
        if served.get(final_id) != 1:
            problems.append(f"request {outcome.index}: the server logged {served.get(final_id, 0)} answers for {final_id}")
    if sum(served.values()) != len(result.outcomes):
        problems.append(f"the server logged {sum(served.values())} plan answers for {len(result.outcomes)} requests")
    for outcome_name in ("crashed", "timed_out", "cancelled"):
        if pool_outcomes(result).get(outcome_name):
            problems.append(f"the solver pool reported {outcome_name} tasks")
    if any(probe.latency_s is None for probe in result.probes):
        problems.append("a health probe failed")
    if result.fetches is not None:
        if result.fetches.failures:
            problems.append(f"{result.fetches.failures} fetches of the largest plan failed or came back short")
        if any(probe.latency_s is None for probe in result.fetches.probes):
            problems.append("a health probe failed while the largest plan was fetched")
    return problems


def pool_outcomes(result: Run) -> dict[str, int]:
    """Solver pool tasks by outcome, from the server's /metrics at the end of the run."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(result.metrics_text):
        if family.name == "resiplan_solver_tasks":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    counts[sample.labels["outcome"]] += int(sample.value)
    return dict(counts)


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = fraction * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def report(result: Run, requests: int, time_limit_s: float) -> str:
    latencies = [o.latency_s for o in result.outcomes if o.latency_s is not None]
    attempts_s = [o.solve_attempt_s for o in result.outcomes if o.solve_attempt_s is not None]
    health_ms = [p.latency_s * 1e3 for p in result.probes if p.latency_s is not None]
    saturated_ms = [p.latency_s * 1e3 for p in result.probes if p.latency_s is not None and
                    p.plans_in_server >= result.workers]
    rejected = sum(o.rejected for o in result.outcomes)
    outcomes = pool_outcomes(result)
    problems = check(result)
    by_size: dict[str, list[float]] = {}
    for outcome in result.outcomes:
        if outcome.solve_attempt_s is not None:
            by_size.setdefault(outcome.size, []).append(outcome.solve_attempt_s)
    statuses = Counter(o.plan["solver"]["status"] for o in result.outcomes if o.plan)
    lines = [
        f"{requests} plan requests sent at once (sizes cycled: {'; '.join(dict.fromkeys(o.size for o in result.outcomes))}), "
        f"`options.time_limit_s` {time_limit_s:g}; server with {result.workers} solver workers and "
        f"{result.queue_size} queue places; a 503 is retried after its `Retry-After`.",
        "",
        "| measure | value |",
        "|---|---:|",
        f"| plan requests answered 200 / sent | {len(latencies)} / {requests} |",
        f"| 503 answers, retried: pool full / deadline passed while queued | {rejected - outcomes.get('expired', 0)} "
        f"/ {outcomes.get('expired', 0)} |",
        f"| latency p50 / p99 / max, s (first send to plan, retries included) | "
        f"{_percentile(latencies, 0.5):.2f} / {_percentile(latencies, 0.99):.2f} / {max(latencies, default=float('nan')):.2f} |",
        f"| answered attempt alone p50 / p99, s | {_percentile(attempts_s, 0.5):.2f} / {_percentile(attempts_s, 0.99):.2f} |",
        f"| throughput, plans/s | {len(latencies) / result.wall_s:.2f} (wall {result.wall_s:.1f} s) |",
        f"| /healthz probes (every run) | {len(health_ms)} |",
        f"| /healthz p50 / p99 / max, ms, whole run | {_percentile(health_ms, 0.5):.1f} / {_percentile(health_ms, 0.99):.1f} "
        f"/ {max(health_ms, default=float('nan')):.1f} |",
        f"| /healthz p50 / p99 / max, ms, while saturated ({len(saturated_ms)} probes) | "
        f"{_percentile(saturated_ms, 0.5):.1f} / {_percentile(saturated_ms, 0.99):.1f} / "
        f"{max(saturated_ms, default=float('nan')):.1f} |",
        f"| solver status of the plans | {', '.join(f'{k} {v}' for k, v in sorted(statuses.items()))} |",
        f"| lost or duplicated requests | {'none' if not problems else len(problems)} |",
        "",
        "| request size | answered | attempt p50 s | attempt max s |",
        "|---|---:|---:|---:|",
    ]
    for size, values in by_size.items():
        lines.append(f"| {size} | {len(values)} | {_percentile(values, 0.5):.2f} | {max(values):.2f} |")
    p99 = _percentile(saturated_ms, 0.99)
    lines += ["", f"Health-check p99 while saturated: {p99:.1f} ms (target < {HEALTH_TARGET_MS:.0f} ms: "
              f"{'met' if p99 < HEALTH_TARGET_MS else 'MISSED'})."]
    if result.fetches is not None:
        lines += ["", *_fetch_report(result.fetches)]
    if problems:
        lines += ["", "Problems:", *[f"- {problem}" for problem in problems]]
    return "\n".join(lines)


def _fetch_report(fetches: Fetches) -> list[str]:
    health_ms = [p.latency_s * 1e3 for p in fetches.probes if p.latency_s is not None]
    fetch_s = fetches.latencies_s
    p99 = _percentile(health_ms, 0.99)
    return [
        f"Then {fetches.clients} clients fetched the largest plan the limits allow (`GET /v1/plans/{{id}}` of "
        f"`LARGEST_PLAN`: {fetches.plan_bytes / 2**20:.1f} MiB of JSON) over and over for {fetches.wall_s:.0f} s:",
        "",
        "| measure | value |",
        "|---|---:|",
        f"| fetches completed / failed | {len(fetch_s)} / {fetches.failures} |",
        f"| fetch latency p50 / p99, s | {_percentile(fetch_s, 0.5):.2f} / {_percentile(fetch_s, 0.99):.2f} |",
        f"| served, MiB/s | {len(fetch_s) * fetches.plan_bytes / 2**20 / fetches.wall_s:.0f} |",
        f"| /healthz p50 / p99 / max, ms ({len(health_ms)} probes) | {_percentile(health_ms, 0.5):.1f} / "
        f"{p99:.1f} / {max(health_ms, default=float('nan')):.1f} |",
        "",
        f"Health-check p99 while the largest plan was fetched: {p99:.1f} ms (target < {HEALTH_TARGET_MS:.0f} ms: "
        f"{'met' if p99 < HEALTH_TARGET_MS else 'MISSED'}).",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="RESIPLAN_SOLVER_WORKERS")
    parser.add_argument("--queue-size", type=int, default=None, help="RESIPLAN_SOLVER_QUEUE_SIZE (default: workers)")
    parser.add_argument("--time-limit-s", type=float, default=5.0, help="options.time_limit_s of every request")
    parser.add_argument("--max-attempts", type=int, default=200, help="per request, 503s included")
    parser.add_argument("--probe-interval-ms", type=float, default=50.0)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole run")
    parser.add_argument("--fetch-clients", type=int, default=4, help="clients fetching the largest plan (phase two)")
    parser.add_argument("--fetch-seconds", type=float, default=20.0, help="length of phase two; 0 skips it")
    parser.add_argument("--quick", action="store_true", help="time limit 1 s (for a smoke run)")
    parser.add_argument("--write", action="store_true", help="write the section into BENCHMARKS.md")
    args = parser.parse_args(argv)
    time_limit_s = 1.0 if args.quick else args.time_limit_s
    result = run(args.requests, args.workers, args.queue_size, time_limit_s, args.max_attempts,
                 args.probe_interval_ms / 1e3, args.timeout, args.fetch_clients, args.fetch_seconds)
    text = report(result, args.requests, time_limit_s)
    print(text)
    errors = [line for line in result.log_lines if line.get("level") in ("error", "critical")]
    if errors:  # the server's own account of what went wrong, for whoever runs this
        print(f"\n{len(errors)} error lines in the server log; the first:\n" + json.dumps(errors[0], indent=1)[:4000])
    if args.write:
        from benchmarks.report import write_section

        command = "python -m benchmarks.load --write"
        if args.requests != 48:
            command += f" --requests {args.requests}"
        write_section("Service under load", command, text)
    return 1 if check(result) else 0


if __name__ == "__main__":
    sys.exit(main())
