"""POST /v1/calibrations, GET /v1/calibrations/{id}, options.calibration_id on plan, estimate and replan.

The measured times here are the built-in model's own predictions times a known factor, so the fit has
a right answer: every prediction moves by that factor and the calibrated estimate of each run equals
its measurement. (How well a calibration carries to runs it has not seen, on published data, is
tests/planner/test_calibration.py.)
"""

from __future__ import annotations

import json

import pytest

from tests.api.support import assert_detail, estimate_request, small_request

SLOWER = 1.25  # the "cluster" runs 25% slower than the built-in model predicts

LAYOUTS = [
    ("llama2-7b", {"tp": 1, "pp": 2, "micro_batch_size": 1, "recompute": "none", "schedule": "1f1b"}),
    ("llama2-13b", {"tp": 2, "pp": 2, "micro_batch_size": 1, "recompute": "selective", "schedule": "1f1b"}),
    ("llama2-7b", {"tp": 4, "pp": 1, "micro_batch_size": 2, "recompute": "none", "schedule": "1f1b"}),
]


def _runs(client) -> list[dict]:
    runs = []
    for model, layout in LAYOUTS:
        body = estimate_request(layout, model=model, training={"global_batch_size": 32, "seq_length": 2048})
        predicted = client.post("/v1/estimate", json=body).json()["predicted"]["iteration_time_s"]
        runs.append({**body, "measured_iteration_time_s": round(predicted * SLOWER, 6)})
    return runs


def test_a_calibration_fits_the_runs_is_stored_and_prices_plans(client):
    runs = _runs(client)
    response = client.post("/v1/calibrations", json={"name": "lab A100s", "runs": runs})
    assert response.status_code == 201, response.text
    calibration = response.json()
    assert calibration["name"] == "lab A100s" and len(calibration["runs"]) == 3
    assert calibration["fitted"] and set(calibration["fitted"]) | set(calibration["unidentified"]) == set(
        calibration["parameters"])
    assert calibration["fit_mape"] < 0.03 and calibration["cross_validated_mape"] < 0.05
    # Every run measured 1.25x its default prediction: the defaults are 1 - 1 / 1.25 = 20% off each.
    assert calibration["default_mape"] == pytest.approx(0.2, abs=2e-5)
    assert not any("further off" in note for note in calibration["notes"])
    # Three runs 22% off in log-time, one parameter: most of the move is taken, and the answer says why not all.
    assert 0.8 < calibration["fit_weight"] < 1
    assert any(f"take {calibration['fit_weight']:.0%} of the move" in note for note in calibration["notes"])
    for run in calibration["runs"]:
        assert run["measured_s"] / 1.25 < run["predicted_s"] < run["measured_s"]
        assert run["predicted_s"] == pytest.approx(run["measured_s"], rel=0.05)
    assert client.get(f"/v1/calibrations/{calibration['calibration_id']}").json() == calibration

    # Applied: an estimate under the calibration predicts what the calibration said, and names it.
    with_id = {**runs[0], "options": {"calibration_id": calibration["calibration_id"]}}
    del with_id["measured_iteration_time_s"]
    estimate = client.post("/v1/estimate", json=with_id).json()
    assert estimate["predicted"]["calibration_id"] == calibration["calibration_id"]
    # Both are rounded to the microsecond, and the stored parameters to 6 decimals: equal to within one unit.
    assert estimate["predicted"]["iteration_time_s"] == pytest.approx(calibration["runs"][0]["predicted_s"],
                                                                      abs=1.01e-6)
    # A plan under it is slower than the built-in model's, and a replan keeps the calibration.
    body = small_request()
    plain = client.post("/v1/plan", json=body).json()
    calibrated = client.post("/v1/plan", json={**body, "options": {
        "time_limit_s": 2, "calibration_id": calibration["calibration_id"]}}).json()
    assert plain["predicted"]["calibration_id"] is None
    assert calibrated["predicted"]["calibration_id"] == calibration["calibration_id"]
    assert calibrated["predicted"]["iteration_time_s"] > 1.1 * plain["predicted"]["iteration_time_s"]
    replanned = client.post(f"/v1/plans/{calibrated['plan_id']}/replan", json={"failures": {"failed": ["1:3"]}}).json()
    assert replanned["predicted"]["calibration_id"] == calibration["calibration_id"]


def test_unknown_calibration_ids_and_bad_runs_are_422_naming_them(client):
    assert client.get("/v1/calibrations/0123456789abcdef0123456789abcdef").status_code == 404
    unknown = small_request(options={"calibration_id": "0123456789abcdef0123456789abcdef"})
    assert_detail(client.post("/v1/plan", json=unknown), "calibration_id", "no stored calibration")
    runs = _runs(client)
    impossible = {**runs[1], "layout": {**runs[1]["layout"], "tp": 3}}
    assert_detail(client.post("/v1/calibrations", json={"name": "x", "runs": [runs[0], impossible]}), "runs[1]")
    not_finite = client.post("/v1/calibrations", content=(
        '{"name": "x", "runs": [{"cluster": {"num_nodes": 1, "gpus_per_node": 8, "gpu": "A100-80GB"}, '
        '"model": "llama2-7b", "training": {"global_batch_size": 8, "seq_length": 2048}, "layout": {"tp": 8, "pp": 1}, '
        '"measured_iteration_time_s": NaN}]}'), headers={"content-type": "application/json"})
    assert not_finite.status_code == 422 and "runs[0].measured_iteration_time_s" in not_finite.text
    assert client.post("/v1/calibrations", json={"name": "x", "runs": []}).status_code == 422


def _rewrite_stored(db_url: str, sql: str, **values) -> None:
    """Write a row as an earlier version of the service would have left it."""
    from sqlalchemy import create_engine, text

    engine = create_engine(db_url)
    with engine.begin() as connection:
        assert connection.execute(text(sql), values).rowcount == 1
    engine.dispose()


def _stored_under_an_earlier_model(client, db_url) -> tuple[list[dict], dict]:
    """A calibration as an earlier cost model left it: that model predicted the runs exactly with the built-in
    parameters, so its fit kept them. The current model prices the same runs 1/SLOWER as fast with them."""
    runs = _runs(client)
    calibration = client.post("/v1/calibrations", json={"name": "old model", "runs": runs}).json()
    earlier = {**calibration, "parameters": calibration["default_parameters"], "fit_mape": 0.0,
               "runs": [{**run, "predicted_s": run["measured_s"], "error": 0.0} for run in calibration["runs"]]}
    _rewrite_stored(db_url, "update calibrations set calibration_json = :json where calibration_id = :id",
                    json=json.dumps(earlier), id=calibration["calibration_id"])
    return runs, calibration


def test_a_calibration_fitted_under_an_earlier_cost_model_is_refitted_to_its_runs_before_it_prices(client, db_url):
    runs, fresh = _stored_under_an_earlier_model(client, db_url)
    calibration_id = fresh["calibration_id"]
    estimate = {key: value for key, value in runs[0].items() if key != "measured_iteration_time_s"}
    plain_s = client.post("/v1/estimate", json=estimate).json()["predicted"]["iteration_time_s"]

    # Applied as stored, the built-in parameters would predict the built-in 1/SLOWER of the measurement; refitted
    # to its runs under the current model, the calibration predicts the measurement again.
    applied = client.post("/v1/estimate", json={**estimate, "options": {"calibration_id": calibration_id}}).json()
    assert applied["predicted"]["calibration_id"] == calibration_id
    assert applied["predicted"]["iteration_time_s"] == pytest.approx(runs[0]["measured_iteration_time_s"], rel=0.02)
    assert applied["predicted"]["iteration_time_s"] > 1.2 * plain_s

    # The refit is stored: it names what it replaced and why, and is the fit a fresh POST of the runs gives.
    stored = client.get(f"/v1/calibrations/{calibration_id}").json()
    assert stored["refit"]["previous_parameters"] == fresh["default_parameters"]
    assert stored["refit"]["previous_fit_mape"] == 0.0
    assert "cost model changed" in stored["refit"]["reason"] and "-20.00%" in stored["refit"]["reason"]
    assert stored["parameters"] == fresh["parameters"]
    assert [run["predicted_s"] for run in stored["runs"]] == [run["predicted_s"] for run in fresh["runs"]]
    # ...and, now current, it is not refitted again.
    assert client.get(f"/v1/calibrations/{calibration_id}").json() == stored


def test_a_calibration_whose_runs_this_model_cannot_price_is_422_naming_it(client, db_url):
    runs, fresh = _stored_under_an_earlier_model(client, db_url)
    runs[1]["layout"] = {**runs[1]["layout"], "tp": 3}  # priced by the earlier model, not by this one
    _rewrite_stored(db_url, "update calibration_runs set runs_json = :json where calibration_id = :id",
                    json=json.dumps({"request": {"name": "old model", "runs": runs}, "plans": {}}),
                    id=fresh["calibration_id"])
    response = client.post("/v1/plan", json=small_request(options={"calibration_id": fresh["calibration_id"]}))
    assert_detail(response, fresh["calibration_id"], "earlier cost model", "runs[1]")


def test_a_calibration_stored_before_its_runs_were_kept_applies_as_stored(client, db_url):
    runs, fresh = _stored_under_an_earlier_model(client, db_url)
    _rewrite_stored(db_url, "delete from calibration_runs where calibration_id = :id", id=fresh["calibration_id"])
    estimate = {key: value for key, value in runs[0].items() if key != "measured_iteration_time_s"}
    plain_s = client.post("/v1/estimate", json=estimate).json()["predicted"]["iteration_time_s"]
    applied = client.post("/v1/estimate", json={**estimate, "options": {"calibration_id": fresh["calibration_id"]}})
    assert applied.json()["predicted"]["iteration_time_s"] == pytest.approx(plain_s, abs=1.01e-6)
    assert client.get(f"/v1/calibrations/{fresh['calibration_id']}").json()["refit"] is None


def test_a_calibration_stored_before_attention_fraction_existed_prices_as_before(client, db_url):
    # attention_fraction joined the parameters after calibrations were stored without it: it defaults to 1, the
    # kernels' modelled speed, which is how those calibrations priced attention.
    runs = _runs(client)
    fresh = client.post("/v1/calibrations", json={"name": "before attention", "runs": runs}).json()
    assert fresh["parameters"]["attention_fraction"] == 1.0 and "attention_fraction" in fresh["unidentified"]
    earlier = {**fresh, "parameters": {k: v for k, v in fresh["parameters"].items() if k != "attention_fraction"}}
    _rewrite_stored(db_url, "update calibrations set calibration_json = :json where calibration_id = :id",
                    json=json.dumps(earlier), id=fresh["calibration_id"])
    estimate = {key: value for key, value in runs[0].items() if key != "measured_iteration_time_s"}
    applied = client.post("/v1/estimate", json={**estimate, "options": {"calibration_id": fresh["calibration_id"]}})
    assert applied.status_code == 200, applied.text
    assert applied.json()["predicted"]["iteration_time_s"] == pytest.approx(fresh["runs"][0]["predicted_s"], abs=1.01e-6)
    assert client.get(f"/v1/calibrations/{fresh['calibration_id']}").json()["refit"] is None


ROLE_SLOWER = 1.3  # the "stack" computes 30% slower than the cost model


def _detected_job(client) -> tuple[dict, dict, dict]:
    """A stored 2-stage, 2-replica TP-1 plan (whose stage times are pure compute), telemetry of its devices
    computing each microbatch ROLE_SLOWER times the plan's stage time, and /v1/detect's answer to it."""
    layout = {"tp": 1, "pp": 2, "dp": 2, "micro_batch_size": 1, "recompute": "none", "schedule": "1f1b"}
    body = estimate_request(layout, cluster={"num_nodes": 1, "gpus_per_node": 4, "gpu": "A100-80GB"},
                            training={"global_batch_size": 16, "seq_length": 2048})
    plan = client.post("/v1/estimate", json=body).json()
    telemetry = []
    for replica in plan["replicas"]:
        for stage in replica["stages"]:
            ms = ROLE_SLOWER * (stage["forward_ms"] + stage["backward_ms"])
            telemetry += [{"device": device, "iteration": iteration, "last_heartbeat_s_ago": 0.1,
                           "microbatches": [{"seq_lengths": [2048], "compute_ms": ms}] * replica["num_microbatches"]}
                          for device in stage["devices"] for iteration in range(4)]
    detected = client.post("/v1/detect", json={"plan_id": plan["plan_id"], "telemetry": telemetry})
    assert detected.status_code == 200, detected.text
    return body, plan, detected.json()


def test_roles_the_detector_measured_calibrate_the_compute(client):
    body, plan, detected = _detected_job(client)
    assert detected["fail_slow"] == [] and len(detected["time_models"]) == 2  # two roles: the two stages
    response = client.post("/v1/calibrations", json={
        "name": "detected", "roles": [{"plan_id": plan["plan_id"], "time_models": detected["time_models"]}]})
    assert response.status_code == 201, response.text
    calibration = response.json()
    assert [run["source"] for run in calibration["runs"]] == ["roles[0].time_models[0]", "roles[0].time_models[1]"]
    by_layers = {tuple(stage["layers"]): stage for stage in plan["replicas"][0]["stages"]}
    for role, run in zip(detected["time_models"], calibration["runs"], strict=True):
        stage = by_layers[tuple(role["layers"])]
        assert run["measured_s"] * 1e3 == pytest.approx(ROLE_SLOWER * (stage["forward_ms"] + stage["backward_ms"]),
                                                        rel=1e-3)
        assert run["predicted_s"] == pytest.approx(run["measured_s"], rel=0.02)
    # Compute alone cannot tell the links apart: they keep their built-in values.
    assert {"nvlink_fraction", "network_fraction"} <= set(calibration["unidentified"])
    assert calibration["fitted"]
    # Applied, the calibration prices the same layout's compute ROLE_SLOWER times the built-in model's.
    plain = plan["predicted"]["breakdown"]["compute_s"]
    calibrated = client.post("/v1/estimate", json={**body, "options": {
        "calibration_id": calibration["calibration_id"]}}).json()["predicted"]["breakdown"]["compute_s"]
    assert calibrated == pytest.approx(ROLE_SLOWER * plain, rel=0.03)


def test_a_calibration_says_which_roles_rest_on_the_cost_models_attention(client):
    """Every microbatch here is one whole sequence (Q / N fixed), so the detector cannot measure attention: both
    roles carry the cost model's factor (source prior), and the calibration says its fit rests on it there."""
    _, plan, detected = _detected_job(client)
    assert {role["source"] for role in detected["time_models"]} == {"prior"}
    calibration = client.post("/v1/calibrations", json={
        "name": "detected", "roles": [{"plan_id": plan["plan_id"], "time_models": detected["time_models"]}]}).json()
    assert _role_notes(calibration) == ["roles[0].time_models[0]", "roles[0].time_models[1]"]
    assert all("not measured" in note for note in calibration["notes"] if note.startswith("roles["))
    measured = [{**role, "source": "role"} for role in detected["time_models"]]
    mixed = [measured[0], detected["time_models"][1]]
    assert _role_notes(client.post("/v1/calibrations", json={
        "name": "measured", "roles": [{"plan_id": plan["plan_id"], "time_models": measured}]}).json()) == []
    assert _role_notes(client.post("/v1/calibrations", json={
        "name": "mixed", "roles": [{"plan_id": plan["plan_id"], "time_models": mixed}]}).json()) == [
        "roles[0].time_models[1]"]


def _role_notes(calibration: dict) -> list[str]:
    """The sources the notes name among the roles (other notes, such as the shrinkage's, name no run)."""
    return [note.split(":")[0] for note in calibration["notes"] if note.startswith("roles[")]


def test_roles_naming_no_plan_or_no_stage_and_empty_requests_are_422(client):
    _, plan, detected = _detected_job(client)
    unknown = {"plan_id": "0123456789abcdef0123456789abcdef", "time_models": detected["time_models"]}
    assert_detail(client.post("/v1/calibrations", json={"name": "x", "roles": [unknown]}), "roles[0].plan_id",
                  "no stored plan")
    elsewhere = {**detected["time_models"][0], "layers": [0, 3]}
    assert_detail(client.post("/v1/calibrations", json={"name": "x", "roles": [
        {"plan_id": plan["plan_id"], "time_models": [elsewhere]}]}), "roles[0].time_models[0]", "[0, 3)")
    assert_detail(client.post("/v1/calibrations", json={"name": "x"}), "nothing to fit")


def test_a_calibration_from_roles_is_refitted_from_its_stored_plans(client, db_url):
    _, plan, detected = _detected_job(client)
    fresh = client.post("/v1/calibrations", json={
        "name": "detected", "roles": [{"plan_id": plan["plan_id"], "time_models": detected["time_models"]}]}).json()
    earlier = {**fresh, "parameters": fresh["default_parameters"],
               "runs": [{**run, "predicted_s": run["measured_s"]} for run in fresh["runs"]]}
    _rewrite_stored(db_url, "update calibrations set calibration_json = :json where calibration_id = :id",
                    json=json.dumps(earlier), id=fresh["calibration_id"])
    refitted = client.get(f"/v1/calibrations/{fresh['calibration_id']}").json()
    assert refitted["refit"]["previous_parameters"] == fresh["default_parameters"]
    assert refitted["parameters"] == fresh["parameters"] and refitted["runs"] == fresh["runs"]


def test_runs_whose_fits_do_not_carry_between_them_are_flagged(client):
    """Runs scattered 40% either side of the default predictions (what a layout-specific effect the model lacks
    looks like, or runs from different stacks): a fit to some chases that scatter and predicts the others worse than
    the defaults do, and the answer says so rather than presenting the fit as an improvement."""
    calibration = _scattered(client, (1.4, 0.7, 1.4))
    # measured = default x factor, so each default prediction is |1 / factor - 1| off
    assert calibration["default_mape"] == pytest.approx((2 * (1 - 1 / 1.4) + (1 / 0.7 - 1)) / 3, abs=2e-5)
    assert calibration["cross_validated_mape"] > calibration["default_mape"]
    assert any("further off than uncalibrated" in note for note in calibration["notes"])


def test_runs_within_the_models_own_error_of_the_defaults_keep_them_and_say_so(client):
    calibration = _scattered(client, (1.05, 0.96, 1.05))
    assert calibration["fit_weight"] == 0 and calibration["parameters"] == pytest.approx(
        calibration["default_parameters"], rel=1e-5)
    assert any("stay at their defaults" in note for note in calibration["notes"])


def _scattered(client, factors: tuple[float, ...]) -> dict:
    runs = _runs(client)
    scattered = [{**run, "measured_iteration_time_s": round(run["measured_iteration_time_s"] / SLOWER * factor, 6)}
                 for run, factor in zip(runs, factors)]
    response = client.post("/v1/calibrations", json={"name": "scattered", "runs": scattered})
    assert response.status_code == 201, response.text
    return response.json()
