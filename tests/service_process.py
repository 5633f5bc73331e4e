"""`resiplan serve` as real processes for tests that crash or share a store between servers.

    with served(database_url, log_path, count=2) as servers:
        servers[0].base_url, servers[0].process

Each server runs on a free loopback port in its own process group (it and the solver workers it
starts), so `kill_group` ends all of them at once with SIGKILL, as a crash would. They are started
together and waited for together; leaving the block kills whatever still runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.live_server import closed_port

ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 60.0
# A free port can be taken between probing it and the server binding it; then the server gets another.
START_ATTEMPTS = 3


@dataclass(frozen=True)
class Server:
    base_url: str
    process: subprocess.Popen


# This checkout's `resiplan` command; tests of an installed wheel run that install's instead.
SOURCE_COMMAND = (sys.executable, "-m", "cli")


def _start(env: dict[str, str], log_path: Path, command: tuple[str, ...], cwd: Path) -> Server:
    port = closed_port()
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [*command, "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    return Server(f"http://127.0.0.1:{port}", process)


def _healthy(server: Server, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            return False
        try:
            if httpx.get(f"{server.base_url}/healthz", timeout=1.0).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    return False


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the server and every process it started: nothing gets to clean up."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=10)


@contextmanager
def served(
    database_url: str, log_path: Path, *, count: int = 1, env: dict[str, str] | None = None,
    command: tuple[str, ...] = SOURCE_COMMAND, cwd: Path = ROOT,
) -> Iterator[list[Server]]:
    environment = {**os.environ, "RESIPLAN_DATABASE_URL": database_url, **(env or {})}
    started: list[Server] = []  # every process, healthy or not: all are killed on the way out

    def start() -> Server:
        started.append(_start(environment, log_path, command, cwd))
        return started[-1]

    try:
        pending = [start() for _ in range(count)]
        healthy: list[Server] = []
        for attempt in range(START_ATTEMPTS):
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            failed = [server for server in pending if not _healthy(server, deadline)]
            healthy += [server for server in pending if server not in failed]
            if not failed:
                break
            if attempt + 1 == START_ATTEMPTS:
                raise RuntimeError(f"a server did not start; the log:\n{log_path.read_text(errors='replace')}")
            for server in failed:
                kill_group(server.process)
            pending = [start() for _ in failed]
        yield healthy
    finally:
        for server in started:
            kill_group(server.process)
