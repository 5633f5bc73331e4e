from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.core.settings import Settings


@pytest.fixture
def db_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/t.db"


@pytest.fixture
def client(db_url):
    # raise_server_exceptions=False: a server error shows up as a 500 status the tests assert against.
    with TestClient(create_app(Settings(database_url=db_url)), raise_server_exceptions=False) as test_client:
        yield test_client
