"""PlanStore on SQLite and PostgreSQL: round trips, ids, several instances on one database."""

from __future__ import annotations

import sqlite3
import threading

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from api.core.store import PlanStore, make_engine, store_url

REQUEST = {"model": "llama2-7b", "cluster": {"num_nodes": 2, "gpus_per_node": 8, "gpu": "A100-80GB"}}


def plan_body(plan_id: str, **extra) -> dict:
    return {"plan_id": plan_id, "status": "optimal", "replicas": [{"id": 0, "stages": []}], "note": "é ✓", **extra}


@pytest.fixture
def store(store_url):
    opened = PlanStore(make_engine(store_url))
    yield opened
    opened.close()


def open_stores(url: str, count: int) -> list[PlanStore]:
    """`count` instances, each with its own engine and connections, as separate service processes have."""
    return [PlanStore(make_engine(url)) for _ in range(count)]


def test_a_saved_plan_and_its_request_read_back_equal(store):
    store.save("a1", REQUEST, plan_body("a1"))
    store.save("b2", {"other": True}, plan_body("b2", extra=[1.5, None]))
    assert store.get("a1") == plan_body("a1")
    assert store.get_request("a1") == REQUEST
    assert store.get("b2") == plan_body("b2", extra=[1.5, None])
    assert store.get_request("b2") == {"other": True}


@pytest.mark.parametrize("plan_id", ["unknown", "", "\x00", "a\x00b", "\ud800", "é", "x" * 10_000])
def test_an_id_no_plan_can_have_reads_as_missing(store, plan_id):
    """Whatever a client puts in a URL or body is "not found", never a database error (a 500)."""
    store.save("a1", REQUEST, plan_body("a1"))
    assert store.get(plan_id) is None
    assert store.get_request(plan_id) is None


def test_an_id_is_saved_once(store):
    store.save("a1", REQUEST, plan_body("a1"))
    with pytest.raises(IntegrityError):
        store.save("a1", {}, plan_body("a1", replaced=True))
    assert store.get("a1") == plan_body("a1")


def test_instances_sharing_one_database_see_each_others_plans(store_url):
    first, second = open_stores(store_url, 2)
    try:
        first.save("from-first", REQUEST, plan_body("from-first"))
        second.save("from-second", {}, plan_body("from-second"))
        assert second.get("from-first") == plan_body("from-first")
        assert second.get_request("from-first") == REQUEST
        assert first.get("from-second") == plan_body("from-second")
    finally:
        first.close()
        second.close()


def _at_once(count: int, work) -> list[BaseException]:
    """Run work(i) in `count` threads released together; the exceptions they raised."""
    barrier = threading.Barrier(count)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        barrier.wait()
        try:
            work(index)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


INSTANCES = 8


def test_instances_starting_at_once_on_an_empty_database_all_start(store_url):
    """Without the schema lock, concurrent CREATE TABLEs collide (PostgreSQL: a unique violation in its
    catalog; SQLite: "table plans already exists") in nearly every round of this test."""
    engines = [make_engine(store_url) for _ in range(INSTANCES)]
    for engine in engines:
        engine.connect().close()  # connected beforehand, so the CREATEs themselves race
    stores: list[PlanStore] = []
    try:
        errors = _at_once(INSTANCES, lambda i: stores.append(PlanStore(engines[i])))
        assert errors == []
        stores[0].save("after", REQUEST, plan_body("after"))
        assert all(store.get("after") == plan_body("after") for store in stores)
    finally:
        for engine in engines:
            engine.dispose()


def test_concurrent_saves_from_several_instances_all_land(store_url):
    stores = open_stores(store_url, 4)
    per_instance = 10
    try:
        errors = _at_once(len(stores), lambda i: [
            stores[i].save(f"p{i}-{n}", {"n": n}, plan_body(f"p{i}-{n}")) for n in range(per_instance)
        ])
        assert errors == []
        for i in range(len(stores)):
            for n in range(per_instance):
                assert stores[(i + 1) % len(stores)].get(f"p{i}-{n}") == plan_body(f"p{i}-{n}")
    finally:
        for store in stores:
            store.close()


def test_sqlite_store_is_in_wal_mode_and_syncs_every_commit(tmp_path):
    path = tmp_path / "plans.db"
    engine = make_engine(f"sqlite:///{path}")
    store = PlanStore(engine)
    try:
        with engine.connect() as connection:
            assert connection.execute(text("PRAGMA synchronous")).scalar() == 2  # FULL
        # The journal mode is a property of the file: another client sees it too.
        with sqlite3.connect(path) as raw:
            assert raw.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    finally:
        store.close()


@pytest.mark.parametrize(
    ("configured", "driver", "database"),
    [
        ("postgresql://u:pw@db.example:5433/plans", "postgresql+psycopg", "plans"),
        ("postgres://u@db.example/plans", "postgresql+psycopg", "plans"),
        ("postgresql+psycopg://u@db.example/plans", "postgresql+psycopg", "plans"),
        ("postgresql+psycopg2://u@db.example/plans", "postgresql+psycopg2", "plans"),
        ("sqlite:///resiplan.db", "sqlite", "resiplan.db"),
    ],
)
def test_database_urls_pick_the_installed_driver(configured, driver, database):
    """Plain `postgresql://` (and `postgres://`) mean psycopg 3, which is what the `postgres` extra installs."""
    url = store_url(configured)
    assert url.drivername == driver
    assert url.database == database


def test_postgres_url_as_users_write_it_reaches_the_server(postgres):
    """The plain `postgresql://` form (socket in a query parameter) works end to end."""
    url = postgres.new_database()
    assert url.startswith("postgresql://")
    engine = make_engine(url)
    assert engine.dialect.driver == "psycopg"
    store = PlanStore(engine)
    try:
        store.save("a1", REQUEST, plan_body("a1"))
        assert store.get("a1") == plan_body("a1")
    finally:
        store.close()


def test_the_plan_bytes_are_exactly_the_saved_text_encoded(store_url):
    """Served without decoding: backslash escapes (PostgreSQL's text-to-bytea cast would read them as
    escapes), non-ASCII text and quotes come back byte for byte."""
    store = PlanStore(make_engine(store_url))
    text_json = '{"plan_id": "c3", "model": "a\\\\x41\\\\\\\\b \\\\u00e9 é ✓ \\"q\\""}'
    store.save_json("c3", "{}", text_json)
    assert store.get_json_bytes("c3") == text_json.encode("utf-8")
    assert store.get_json("c3") == text_json
    assert store.get_json_bytes("unknown") is None and store.get_json_bytes("\ud800") is None
    store.close()


def test_recently_served_plans_are_kept_within_the_cache_size(tmp_path):
    url = f"sqlite:///{tmp_path}/cache.db"
    store = PlanStore(make_engine(url), cache_bytes=2_500)
    for plan_id in ("p1", "p2", "p3"):
        store.save_json(plan_id, "{}", '{"x": "' + plan_id * 500 + '"}')  # ~1 KB each
    first = store.get_json_bytes("p1")
    with sqlite3.connect(tmp_path / "cache.db") as raw:  # change the row behind the store's back
        raw.execute("update plans set plan_json = '{}' where plan_id in ('p1', 'p2', 'p3')")
    assert store.get_json_bytes("p1") == first, "a served plan is answered from memory"
    assert store.get_json_bytes("p2") == b"{}" and store.get_json_bytes("p3") == b"{}"  # read now: {}
    store.save_json("big", "{}", '{"x": "' + "y" * 3_000 + '"}')
    assert store.get_json_bytes("big").startswith(b'{"x": "yyy')  # too big to keep: read, not cached
    with sqlite3.connect(tmp_path / "cache.db") as raw:
        raw.execute("update plans set plan_json = '{}' where plan_id = 'big'")
    assert store.get_json_bytes("big") == b"{}"
    store.close()
