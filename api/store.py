"""Plan store: every plan the service returns is kept (SQLAlchemy; SQLite by default)."""

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
)
from sqlalchemy.engine import Engine

_metadata = MetaData()

plans_table = Table(
    "plans",
    _metadata,
    Column("plan_id", String(64), primary_key=True),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("request_json", Text, nullable=False),
    Column("plan_json", Text, nullable=False),
)


def _sqlite_wal(dbapi_connection, _record) -> None:
    # WAL keeps readers off the writer's back and survives a crash mid-write.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def make_engine(database_url: str) -> Engine:
    is_sqlite = database_url.startswith("sqlite")
    engine = create_engine(
        database_url,
        connect_args={"check_same_thread": False} if is_sqlite else {},
        pool_pre_ping=not is_sqlite,
    )
    if is_sqlite:
        event.listen(engine, "connect", _sqlite_wal)
    return engine


class PlanStore:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        _metadata.create_all(engine)

    def save(self, plan_id: str, request: dict[str, Any], plan: dict[str, Any]) -> None:
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
        with self._engine.connect() as connection:
            row = connection.execute(select(plans_table.c.plan_json).where(plans_table.c.plan_id == plan_id)).first()
        return None if row is None else json.loads(row[0])

    def get_request(self, plan_id: str) -> dict[str, Any] | None:
        """The request a stored plan answered (a replan starts from it)."""
        with self._engine.connect() as connection:
            row = connection.execute(
                select(plans_table.c.request_json).where(plans_table.c.plan_id == plan_id)
            ).first()
        return None if row is None else json.loads(row[0])

    def close(self) -> None:
        self._engine.dispose()
