"""Plan store: every plan the service returns is kept (SQLAlchemy; SQLite by default, PostgreSQL to share).

A route saves a plan, and the save commits, before the plan is sent, so a client holding a plan id
can read that plan after any crash of the service.

- SQLite (the default, one service process or several on one host): WAL journal with
  `synchronous=FULL`. In WAL mode a commit is an append to the log, so readers never wait for the
  writer. A commit survives a killed process at any synchronous level (it is in the OS page cache
  once `COMMIT` returns); FULL also syncs the log to disk at every commit, so a power cut or kernel
  crash cannot lose a plan whose id a client already holds. One fsync per plan is nothing next to a
  solve.
- PostgreSQL (`postgresql://...`, several service instances sharing one store): psycopg 3
  (`pip install 'resiplan[postgres]'`); the server's default `synchronous_commit=on` makes a commit
  durable before it returns.

A store that cannot be reached (PostgreSQL stopped, a disk full, a locked file) raises `StoreUnavailable`
from every method, which the API answers with 503 and `Retry-After`; the schema is created on first use,
so the service also starts while its database is down and becomes ready when it comes back.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    Column,
    DateTime,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    cast,
    create_engine,
    event,
    func,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.schema import CreateTable

log = logging.getLogger("resiplan.store")

_metadata = MetaData()

plans_table = Table(
    "plans",
    _metadata,
    Column("plan_id", String(64), primary_key=True),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("request_json", Text, nullable=False),
    Column("plan_json", Text, nullable=False),
)

calibrations_table = Table(
    "calibrations",
    _metadata,
    Column("calibration_id", String(64), primary_key=True),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("calibration_json", Text, nullable=False),
)

# The measured runs a calibration was fitted to (its POST body), kept so that the service can refit them when a
# later cost model prices them differently. A table of its own: calibrations stored before it have no row here,
# and adding a column would need a migration that `CREATE TABLE IF NOT EXISTS` does not do.
calibration_runs_table = Table(
    "calibration_runs",
    _metadata,
    Column("calibration_id", String(64), primary_key=True),
    Column("runs_json", Text, nullable=False),
)

# Seconds to reach a PostgreSQL server before the store counts as unavailable (an unreachable host would
# otherwise hold a request for the TCP timeout, minutes).
POSTGRES_CONNECT_TIMEOUT_S = 5
# Seconds a SQLite writer waits for another's lock (threads of one server, or several servers on one file).
SQLITE_BUSY_TIMEOUT_S = 30.0
# Any fixed 64-bit number: the key of the PostgreSQL advisory lock taken while creating the schema.
_SCHEMA_LOCK_KEY = 0x7265_7369_706C_616E  # "resiplan"

# `postgresql://` alone would make SQLAlchemy look for psycopg2; `postgres://` is what many hosts hand out.
_POSTGRES_SCHEMES = frozenset({"postgresql", "postgres"})


def store_url(database_url: str) -> URL:
    """The SQLAlchemy URL for RESIPLAN_DATABASE_URL: plain `postgresql://` and `postgres://` mean psycopg 3."""
    url = make_url(database_url)
    if url.drivername in _POSTGRES_SCHEMES:
        url = url.set(drivername="postgresql+psycopg")
    return url


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")  # why FULL and not NORMAL: see the module docstring
    cursor.close()


def make_engine(database_url: str) -> Engine:
    url = store_url(database_url)
    is_sqlite = url.get_backend_name() == "sqlite"
    try:
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_S} if is_sqlite
            else {"connect_timeout": POSTGRES_CONNECT_TIMEOUT_S},
            # A shared server restarts or drops idle connections; test each one before handing it out.
            pool_pre_ping=not is_sqlite,
        )
    except ModuleNotFoundError as error:
        raise RuntimeError(
            f"the plan store {url.render_as_string(hide_password=True)} needs the Python module {error.name!r}; "
            "for PostgreSQL install resiplan with the `postgres` extra (psycopg 3)"
        ) from error
    if is_sqlite:
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def create_schema(connection: Connection) -> None:
    """Create the tables if they are missing; safe when several instances start at once on one database.

    `CREATE TABLE IF NOT EXISTS` alone still races on PostgreSQL (two creators collide on a catalog
    index), so there a transaction-scoped advisory lock lets one instance create while the others
    wait, then find the table.
    """
    if connection.dialect.name == "postgresql":
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _SCHEMA_LOCK_KEY})
    for table in _metadata.sorted_tables:
        connection.execute(CreateTable(table, if_not_exists=True))


# What a stopped server, a dropped connection, an exhausted pool, a full disk or a locked file raise.
_OUTAGES = (OperationalError, InterfaceError, DisconnectionError, PoolTimeoutError)


class StoreUnavailable(Exception):
    """The plan store could not be reached or did not answer; the message names the store, never a password."""


def _could_be_stored(plan_id: str) -> bool:
    # Saved ids are hex. Anything else a client sends is answered "not found" without a query: a lone
    # surrogate cannot be encoded for either database, and PostgreSQL rejects NUL in any text (a 500 otherwise).
    return len(plan_id) <= plans_table.c.plan_id.type.length and plan_id.isascii() and "\x00" not in plan_id


class _RecentPlans:
    """The plan JSON bytes served last, up to `max_bytes` in all. Plans are never changed once stored, so
    a copy cannot go stale, whichever instance of the service stored it; after a replan every node of a
    job asks for the same plan at once, and each read of a 30 MB row costs the interpreter milliseconds."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._plans: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, plan_id: str) -> bytes | None:
        with self._lock:
            found = self._plans.get(plan_id)
            if found is not None:
                self._plans.move_to_end(plan_id)
            return found

    def put(self, plan_id: str, body: bytes) -> None:
        if len(body) > self._max_bytes:
            return
        with self._lock:
            if plan_id in self._plans:
                return
            self._plans[plan_id] = body
            self._bytes += len(body)
            while self._bytes > self._max_bytes:
                _, evicted = self._plans.popitem(last=False)
                self._bytes -= len(evicted)


class PlanStore:
    """Thread-safe (SQLAlchemy's connection pool); the API calls it from worker threads. `cache_bytes`:
    how much recently served plan JSON to keep in memory (0: none)."""

    def __init__(self, engine: Engine, cache_bytes: int = 0) -> None:
        self._engine = engine
        self._recent = _RecentPlans(cache_bytes)
        self._schema_ready = False
        self._schema_lock = threading.Lock()
        try:
            self._ensure_schema()
        except StoreUnavailable as error:
            log.warning("plan store unavailable at start; it is created on first use: %s", error)

    def _describe(self) -> str:
        return self._engine.url.render_as_string(hide_password=True)

    def _ensure_schema(self) -> None:
        if self._schema_ready:
            return
        with self._schema_lock:
            if self._schema_ready:
                return
            with self._guard("create the plan table"), self._engine.begin() as connection:
                create_schema(connection)
            self._schema_ready = True

    @contextmanager
    def _guard(self, action: str) -> Iterator[None]:
        """A database that cannot be reached or cannot work now as StoreUnavailable. Integrity errors (one id
        saved twice) are bugs, not outages, and pass through."""
        try:
            yield
        except _OUTAGES as error:
            reason = type(getattr(error, "orig", None) or error).__name__
            raise StoreUnavailable(f"the plan store ({self._describe()}) could not {action}: {reason}") from error

    def save(self, plan_id: str, request: dict[str, Any], plan: dict[str, Any]) -> None:
        """Insert and commit (returns only once the plan is durable); a second save of one id raises."""
        self.save_json(plan_id, json.dumps(request), json.dumps(plan))

    def save_json(self, plan_id: str, request_json: str, plan_json: str) -> None:
        """`save` of texts already serialized (the solver worker serializes plans, off the event loop)."""
        self._ensure_schema()
        with self._guard("save a plan"), self._engine.begin() as connection:
            connection.execute(
                insert(plans_table).values(
                    plan_id=plan_id,
                    created_at=datetime.now(UTC),
                    request_json=request_json,
                    plan_json=plan_json,
                )
            )

    def get(self, plan_id: str) -> dict[str, Any] | None:
        text = self.get_json(plan_id)
        return None if text is None else json.loads(text)

    def get_json(self, plan_id: str) -> str | None:
        """The stored plan as the JSON text it was saved as: served as is, never parsed."""
        return self._column(plans_table.c.plan_json, plan_id)

    def get_json_bytes(self, plan_id: str) -> bytes | None:
        """`get_json` as the UTF-8 bytes sent on the wire, converted by the database: a plan of tens of MB
        is served without decoding and re-encoding it in Python, which holds the interpreter for
        milliseconds per MB."""
        if not _could_be_stored(plan_id):
            return None
        cached = self._recent.get(plan_id)
        if cached is not None:
            return cached
        self._ensure_schema()
        with self._guard("read a plan"), self._engine.connect() as connection:
            column = plans_table.c.plan_json
            # PostgreSQL's text-to-bytea cast reads backslashes as escapes; convert_to encodes instead.
            as_bytes = (func.convert_to(column, "UTF8") if connection.dialect.name == "postgresql"
                        else cast(column, LargeBinary))
            row = connection.execute(select(as_bytes).where(plans_table.c.plan_id == plan_id)).first()
        if row is None:
            return None
        body = bytes(row[0])
        self._recent.put(plan_id, body)
        return body

    def get_request(self, plan_id: str) -> dict[str, Any] | None:
        """The request a stored plan answered (a replan starts from it)."""
        text = self._column(plans_table.c.request_json, plan_id)
        return None if text is None else json.loads(text)

    def _column(self, column: Column, plan_id: str) -> str | None:
        if not _could_be_stored(plan_id):
            return None
        self._ensure_schema()
        with self._guard("read a plan"), self._engine.connect() as connection:
            row = connection.execute(select(column).where(plans_table.c.plan_id == plan_id)).first()
        return None if row is None else row[0]

    def save_calibration(self, calibration_id: str, calibration_json: str, runs_json: str) -> None:
        """Insert and commit a fitted calibration and the runs it was fitted to (POST /v1/calibrations)."""
        self._ensure_schema()
        with self._guard("save a calibration"), self._engine.begin() as connection:
            connection.execute(insert(calibrations_table).values(
                calibration_id=calibration_id, created_at=datetime.now(UTC), calibration_json=calibration_json))
            connection.execute(insert(calibration_runs_table).values(calibration_id=calibration_id,
                                                                     runs_json=runs_json))

    def replace_calibration_json(self, calibration_id: str, calibration_json: str) -> None:
        """Commit a calibration refitted to its own runs under the current cost model."""
        self._ensure_schema()
        with self._guard("update a calibration"), self._engine.begin() as connection:
            connection.execute(update(calibrations_table)
                               .where(calibrations_table.c.calibration_id == calibration_id)
                               .values(calibration_json=calibration_json))

    def get_calibration_runs_json(self, calibration_id: str) -> str | None:
        """The runs a stored calibration was fitted to; None for one stored before the service kept them."""
        if not _could_be_stored(calibration_id):
            return None
        self._ensure_schema()
        with self._guard("read a calibration's runs"), self._engine.connect() as connection:
            row = connection.execute(select(calibration_runs_table.c.runs_json)
                                     .where(calibration_runs_table.c.calibration_id == calibration_id)).first()
        return None if row is None else row[0]

    def get_calibration_json(self, calibration_id: str) -> str | None:
        if not _could_be_stored(calibration_id):
            return None
        self._ensure_schema()
        with self._guard("read a calibration"), self._engine.connect() as connection:
            row = connection.execute(select(calibrations_table.c.calibration_json)
                                     .where(calibrations_table.c.calibration_id == calibration_id)).first()
        return None if row is None else row[0]

    def check(self) -> None:
        """Raise StoreUnavailable unless the store answers a query now (readiness)."""
        self._ensure_schema()
        with self._guard("answer a query"), self._engine.connect() as connection:
            connection.execute(select(plans_table.c.plan_id).limit(1)).first()

    def close(self) -> None:
        self._engine.dispose()
