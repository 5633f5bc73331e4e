"""options.memory_reserve_gib: what every plan leaves free per GPU, and its documented default."""

from __future__ import annotations

from tests.api.support import assert_detail, estimate_request, small_request

# README, "Memory reserve".
DEFAULT_RESERVE_GIB = 3.0


def _stages(plan: dict) -> list[dict]:
    return [stage for replica in plan["replicas"] for stage in replica["stages"]]


def test_default_reserve_leaves_three_gib_free_on_every_gpu(client):
    # llama2-7b at 4k tokens on 16 A100-80GB: without a reserve the best plan fills a GPU past 77 GiB.
    body = small_request(training={"global_batch_size": 64, "seq_length": 4096})
    plan = client.post("/v1/plan", json=body).json()
    assert plan["memory_reserve_gib"] == DEFAULT_RESERVE_GIB and plan["gpu_memory_gib"] == 80.0
    assert max(stage["memory_gib"] for stage in _stages(plan)) <= 80.0 - DEFAULT_RESERVE_GIB
    unreserved = client.post("/v1/plan", json={**body, "options": {"memory_reserve_gib": 0, "time_limit_s": 2}}).json()
    assert unreserved["memory_reserve_gib"] == 0
    assert 80.0 - DEFAULT_RESERVE_GIB < max(stage["memory_gib"] for stage in _stages(unreserved)) <= 80.0


def test_a_larger_reserve_is_kept_and_changes_what_fits(client):
    layout = {"tp": 1, "pp": 4, "micro_batch_size": 4, "recompute": "none", "schedule": "1f1b"}
    body = estimate_request(layout, model="llama2-13b", training={"global_batch_size": 64, "seq_length": 2048})
    fits = client.post("/v1/estimate", json=body)
    assert fits.status_code == 200, fits.text
    fullest = max(stage["memory_gib"] for stage in _stages(fits.json()))
    # A reserve that leaves less than the fullest stage needs: the same layout no longer runs.
    tight = {**body, "options": {"memory_reserve_gib": 80.0 - fullest + 1.0}}
    detail = assert_detail(client.post("/v1/estimate", json=tight), "GiB", "memory reserve")
    assert f"{80.0 - fullest + 1.0:g} GiB memory reserve" in detail
    # Planning under that reserve finds another layout, and every stage respects it.
    planned = client.post("/v1/plan", json={**small_request(model="llama2-13b",
                                                            training={"global_batch_size": 64, "seq_length": 2048}),
                                            "options": {"memory_reserve_gib": 20, "time_limit_s": 2}}).json()
    assert planned["memory_reserve_gib"] == 20
    assert max(stage["memory_gib"] for stage in _stages(planned)) <= 60.0


def test_a_reserve_as_large_as_the_gpu_is_refused(client):
    body = small_request(options={"memory_reserve_gib": 80})
    assert_detail(client.post("/v1/plan", json=body), "memory_reserve_gib", "80", "A100-80GB")
    negative = client.post("/v1/plan", json=small_request(options={"memory_reserve_gib": -1}))
    assert negative.status_code == 422 and "memory_reserve_gib" in negative.text
