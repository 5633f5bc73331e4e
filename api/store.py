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
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    Column,
    DateTime,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    event,
    insert,
    select,
    text,
)
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.schema import CreateTable

_metadata = MetaData()

plans_table = Table(
    "plans",
    _metadata,
    Column("plan_id", String(64), primary_key=True),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("request_json", Text, nullable=False),
    Column("plan_json", Text, nullable=False),
)

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
            connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_S} if is_sqlite else {},
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


def _could_be_stored(plan_id: str) -> bool:
    # Saved ids are hex. Anything else a client sends is answered "not found" without a query: a lone
    # surrogate cannot be encoded for either database, and PostgreSQL rejects NUL in any text (a 500 otherwise).
    return len(plan_id) <= plans_table.c.plan_id.type.length and plan_id.isascii() and "\x00" not in plan_id


class PlanStore:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        with engine.begin() as connection:
            create_schema(connection)

    def save(self, plan_id: str, request: dict[str, Any], plan: dict[str, Any]) -> None:
        """Insert and commit (returns only once the plan is durable); a second save of one id raises."""
        with self._engine.begin() as connection:
            connection.execute(
                insert(plans_table).values(
                    plan_id=plan_id,
                    created_at=datetime.now(UTC),
                    request_json=json.dumps(request),
                    plan_json=json.dumps(plan),
                )
            )

    def get(self, plan_id: str) -> dict[str, Any] | None:
        if not _could_be_stored(plan_id):
            return None
        with self._engine.connect() as connection:
            row = connection.execute(select(plans_table.c.plan_json).where(plans_table.c.plan_id == plan_id)).first()
        return None if row is None else json.loads(row[0])

    def get_request(self, plan_id: str) -> dict[str, Any] | None:
        """The request a stored plan answered (a replan starts from it)."""
        if not _could_be_stored(plan_id):
            return None
        with self._engine.connect() as connection:
            row = connection.execute(
                select(plans_table.c.request_json).where(plans_table.c.plan_id == plan_id)
            ).first()
        return None if row is None else json.loads(row[0])

    def close(self) -> None:
        self._engine.dispose()
