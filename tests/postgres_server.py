"""A throwaway PostgreSQL server for tests: a fresh cluster in a temporary directory.

    with postgres_server() as server:
        url = server.new_database()   # postgresql://postgres@/db_1f2e...?host=/tmp/resiplan-pg-...

It runs Debian's server binaries (`dev.py test` installs the `postgresql` package when they are
missing), listens only on a Unix socket inside its own directory (no port to collide with another
server, no network), trusts local connections, and is stopped and deleted on exit. initdb and the
server refuse to run as root, so as root they run as Debian's `postgres` user, which owns the directory.
Failing to start raises: the tests that need it then fail, they are never skipped.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

DEBIAN_SERVER_DIRS = Path("/usr/lib/postgresql")
SUPERUSER = "postgres"
START_TIMEOUT_S = 60


class PostgresUnavailable(RuntimeError):
    pass


def server_bindir() -> Path:
    """The newest Debian server installation, else whichever `pg_ctl` is on PATH."""
    installed = [path.parent for path in DEBIAN_SERVER_DIRS.glob("*/bin/pg_ctl")]
    if installed:
        return max(installed, key=lambda path: int(path.parent.name) if path.parent.name.isdigit() else 0)
    on_path = shutil.which("pg_ctl")
    if on_path:
        return Path(on_path).resolve().parent
    raise PostgresUnavailable(
        f"no PostgreSQL server binaries (looked in {DEBIAN_SERVER_DIRS}/*/bin and PATH); "
        "`python3 dev.py test` installs Debian's postgresql package"
    )


@dataclass(frozen=True)
class PostgresServer:
    socket_dir: Path
    data_dir: Path
    bindir: Path
    command_prefix: tuple[str, ...]  # runs the server binaries as the `postgres` user when we are root
    log: Path

    def start(self) -> None:
        """Start the server (again, after `stop`): it keeps its databases."""
        # Only the socket in our own directory; fsync off: the cluster is deleted after the tests.
        options = f"-c listen_addresses='' -k {self.socket_dir} -c fsync=off"
        _run([*self.command_prefix, str(self.bindir / "pg_ctl"), "start", "-D", str(self.data_dir), "-l",
              str(self.log), "-w", "-t", str(START_TIMEOUT_S), "-o", options], "pg_ctl start")

    def stop(self) -> None:
        """Stop the server at once, as a crash or an outage would: clients lose their connections."""
        subprocess.run([*self.command_prefix, str(self.bindir / "pg_ctl"), "stop", "-D", str(self.data_dir),
                        "-m", "immediate", "-w"], capture_output=True, timeout=START_TIMEOUT_S, check=False)

    def url(self, database: str) -> str:
        return f"postgresql://{SUPERUSER}@/{database}?host={self.socket_dir}"

    def new_database(self) -> str:
        """A new empty database's URL (the plain `postgresql://` form users configure)."""
        import psycopg

        name = f"db_{uuid.uuid4().hex}"
        with psycopg.connect(host=str(self.socket_dir), user=SUPERUSER, dbname="postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


def _as_server_user() -> tuple[list[str], int | None, int | None]:
    """The command prefix and owner ids that run the server binaries as a non-root user."""
    if os.geteuid() != 0:
        return [], None, None
    try:
        user = pwd.getpwnam(SUPERUSER)
    except KeyError:
        raise PostgresUnavailable(
            f"running as root and there is no {SUPERUSER!r} user to run PostgreSQL as "
            "(Debian's postgresql package creates it)"
        ) from None
    return ["runuser", "-u", SUPERUSER, "--"], user.pw_uid, user.pw_gid


def _run(command: list[str], what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=START_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise PostgresUnavailable(f"{what} failed ({done.returncode}): {done.stdout}{done.stderr}")


@contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    bindir = server_bindir()
    prefix, uid, gid = _as_server_user()
    # Short and fixed-depth: a Unix socket path must fit in 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="resiplan-pg-"))
    data = root / "data"
    log = root / "server.log"
    started = False
    try:
        if uid is not None:
            os.chown(root, uid, gid)
        _run([*prefix, str(bindir / "initdb"), "-D", str(data), "-U", SUPERUSER, "--auth=trust",
              "--encoding=UTF8", "--locale=C", "--no-sync"], "initdb")
        server = PostgresServer(socket_dir=root, data_dir=data, bindir=bindir, command_prefix=tuple(prefix), log=log)
        server.start()
        started = True
        yield server
    except PostgresUnavailable as error:
        server_log = log.read_text(errors="replace") if log.exists() else ""
        raise PostgresUnavailable(f"{error}\n{server_log}") from None
    finally:
        if started:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)
