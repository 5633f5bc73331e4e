"""The service killed with SIGKILL in the middle of a burst of plan requests loses no plan it answered.

A real `resiplan serve` process (and its solver workers, one process group) on a loopback port;
concurrent plan requests; SIGKILL once some plans have come back while others are still being
solved; a new server on the same store. Every plan whose response arrived in full must read back
identical: the route commits a plan before it sends it.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.api.support import small_request
from tests.service_process import kill_group, served

BURST_REQUESTS = 40
CONCURRENCY = 6
# SIGKILL once this many plans have been answered: by then the other requests are queued or solving.
KILL_AFTER_PLANS = 4
BURST_TIMEOUT_S = 60.0
# Room for the whole burst to wait for a solver rather than be turned away with 503.
SERVER_ENV = {"RESIPLAN_SOLVER_QUEUE_SIZE": str(BURST_REQUESTS)}


def _burst(base_url: str, enough: threading.Event) -> tuple[dict[str, dict], list[str]]:
    """Send BURST_REQUESTS plan requests, CONCURRENCY at a time; the plans received in full (by id) and
    what happened to the others. Sets `enough` once KILL_AFTER_PLANS plans are in."""
    received: dict[str, dict] = {}
    others: list[str] = []
    lock = threading.Lock()

    def one(seed: int, client: httpx.Client) -> None:
        body = small_request(options={"time_limit_s": 2, "random_seed": seed})
        try:
            response = client.post(f"{base_url}/v1/plan", json=body)
            plan = response.json() if response.status_code == 200 else None
        except (httpx.TransportError, ValueError) as error:
            with lock:
                others.append(type(error).__name__)
            return
        with lock:
            if plan is None:
                others.append(str(response.status_code))
            else:
                received[plan["plan_id"]] = plan
                if len(received) >= KILL_AFTER_PLANS:
                    enough.set()

    limits = httpx.Limits(max_connections=CONCURRENCY)
    with httpx.Client(timeout=BURST_TIMEOUT_S, limits=limits) as client, ThreadPoolExecutor(CONCURRENCY) as pool:
        for future in [pool.submit(one, seed, client) for seed in range(BURST_REQUESTS)]:
            future.result()
    return received, others


def test_sigkill_mid_burst_loses_no_answered_plan(store_url, tmp_path):
    log = tmp_path / "server.log"
    enough = threading.Event()
    result: dict[str, tuple[dict[str, dict], list[str]]] = {}
    with served(store_url, log, env=SERVER_ENV) as [server]:
        sender = threading.Thread(target=lambda: result.setdefault("burst", _burst(server.base_url, enough)))
        sender.start()
        assert enough.wait(BURST_TIMEOUT_S), f"fewer than {KILL_AFTER_PLANS} plans answered; log:\n{log.read_text()}"
        kill_group(server.process)
        sender.join(BURST_TIMEOUT_S)
    received, others = result["burst"]
    assert len(received) >= KILL_AFTER_PLANS
    # The kill came mid-burst: some requests were being solved (their connections broke) and got no plan.
    in_flight = [outcome for outcome in others if outcome in {"ReadError", "RemoteProtocolError"}]
    assert in_flight, f"no request was in flight at the kill; the test did not crash the server mid-burst: {others}"
    # Cut off by the kill (or, had the queue filled, turned away): anything else is a server failure.
    assert set(others) <= {"ReadError", "RemoteProtocolError", "ConnectError", "WriteError", "503"}, others

    with served(store_url, log) as [server], httpx.Client(timeout=10) as client:
        for plan_id, plan in received.items():
            stored = client.get(f"{server.base_url}/v1/plans/{plan_id}")
            assert stored.status_code == 200, f"answered plan {plan_id} lost in the crash: {stored.text}"
            assert stored.json() == plan
