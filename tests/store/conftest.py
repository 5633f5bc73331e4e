"""Store tests run on both backends: an SQLite file and a throwaway PostgreSQL server (never skipped)."""

from __future__ import annotations

import pytest

from tests.postgres_server import PostgresServer, postgres_server


@pytest.fixture(scope="session")
def postgres() -> PostgresServer:
    with postgres_server() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path) -> str:
    """An empty database: a new SQLite file, or a new database on the session's PostgreSQL server."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/plans.db"
    return request.getfixturevalue("postgres").new_database()
