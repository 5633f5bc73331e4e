"""The API tests' TestClient fixture (a fresh app and SQLite store per test)."""

from tests.api.conftest import client, db_url  # noqa: F401
