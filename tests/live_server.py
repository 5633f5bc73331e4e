"""A real HTTP server for tests: an ASGI app under uvicorn in a background thread.

    with live_server(create_app(Settings(database_url=url))) as base_url:
        httpx.get(f"{base_url}/healthz")

The socket is bound to port 0, so the kernel picks a free port and no other process can take it
between choosing and binding. Startup (the app's lifespan) finishes before the URL is handed out;
leaving the block shuts uvicorn down gracefully and joins the thread.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

STARTUP_TIMEOUT_S = 30.0


@contextmanager
def live_server(app, *, host: str = "127.0.0.1") -> Iterator[str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5))
    failure: list[BaseException] = []

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as error:  # noqa: BLE001 - reported to the test below
            failure.append(error)

    thread = threading.Thread(target=run, name=f"uvicorn:{port}", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not server.started:
            if failure or not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {host}:{port}: {failure[0] if failure else 'timeout'}")
            time.sleep(0.02)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def closed_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on (bound and released again): connecting to it is refused at once."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
