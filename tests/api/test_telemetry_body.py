"""The /v1/detect body parser (api.tasks.telemetry_body): totals, memory, and 422s a client can read and we can send."""

from __future__ import annotations

import json
import pickle
import random
import tracemalloc

import pytest

import api.tasks.telemetry_body
from api.tasks.telemetry_body import (
    MAX_REPORTED_ERRORS,
    BodyValidationError,
    parse_detect_body,
)
from detector import Microbatch, TelemetryItem


def _item(device: str = "0:0", iteration: int = 1, **overrides) -> dict:
    body = {"device": device, "iteration": iteration,
            "microbatches": [{"seq_lengths": [1024, 1024], "compute_ms": 30.0}], "last_heartbeat_s_ago": 0.2}
    body.update(overrides)
    return body


def _body(telemetry, plan_id="p1") -> bytes:
    return json.dumps({"plan_id": plan_id, "telemetry": telemetry}).encode()


def _random_telemetry(devices: int, iterations: int, seed: int = 0, packed: int | None = None) -> list[dict]:
    """Random lengths and times; `packed`: every item has 8 microbatches of that many sequences (else 0-8
    microbatches of 1-12)."""
    rng = random.Random(seed)

    def count(most: int) -> int:
        return rng.randint(0 if most == 8 else 1, most) if packed is None else (8 if most == 8 else packed)

    return [
        {"device": f"{d // 8}:{d % 8}", "iteration": i,
         "microbatches": [{"seq_lengths": [rng.randint(16, 8192) for _ in range(count(12))],
                           "compute_ms": round(rng.uniform(30, 60), 4)} for _ in range(count(8))],
         "last_heartbeat_s_ago": round(rng.uniform(0, 40), 3)}
        for d in range(devices) for i in range(iterations)
    ]


def _rejection(body: bytes | str) -> BodyValidationError:
    raw = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    with pytest.raises(BodyValidationError) as raised:
        parse_detect_body(raw)
    error = raised.value
    # Whatever was sent, the answer can be sent: strict UTF-8 JSON, short, one sentence plus fields.
    answer = json.dumps({"detail": error.detail, "errors": error.errors}, ensure_ascii=False).encode("utf-8")
    assert len(answer) < 4000, answer[:300]
    assert isinstance(error.detail, str) and error.detail
    assert all(set(entry) == {"field", "message"} for entry in error.errors)
    return error


def _fields(error: BodyValidationError) -> dict[str, str]:
    return {entry["field"]: entry["message"] for entry in error.errors}


# -- what is kept ----------------------------------------------------------------------------------------


def test_each_item_becomes_the_totals_of_its_microbatches():
    telemetry = _random_telemetry(devices=16, iterations=4)
    parsed = parse_detect_body(_body(telemetry, plan_id="abc"))
    assert parsed.plan_id == "abc"
    # The reference: the library's own items, built from the same JSON, and their totals.
    expected = [
        TelemetryItem(item["device"], item["iteration"],
                      tuple(Microbatch(tuple(mb["seq_lengths"]), mb["compute_ms"]) for mb in item["microbatches"]),
                      item["last_heartbeat_s_ago"]).totals()
        for item in telemetry
    ]
    assert list(parsed.telemetry) == expected
    first = telemetry[0]["microbatches"]
    assert parsed.telemetry[0].tokens == sum(sum(mb["seq_lengths"]) for mb in first)
    assert parsed.telemetry[0].squared_lengths == sum(length ** 2 for mb in first for length in mb["seq_lengths"])
    assert any(totals.microbatches == 0 and totals.compute_ms == 0 for totals in parsed.telemetry)


def test_parsing_holds_about_the_bodys_text_not_an_object_per_number():
    """The former whole-body validation peaked at ~9x the body in Python objects alone (measured with this
    same body); item by item it is the text plus ~200 bytes per item."""
    body = _body(_random_telemetry(devices=256, iterations=8, seed=3, packed=16))
    assert len(body) > 2_000_000
    tracemalloc.start()
    try:
        parsed = parse_detect_body(body)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(parsed.telemetry) == 256 * 8
    assert peak_bytes < 1.5 * len(body), f"peak {peak_bytes / len(body):.2f}x the body"


# -- what is refused, and how it is said ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("telemetry_json", "field", "fragment"),
    [
        (json.dumps([_item(), _item(microbatches=[{"seq_lengths": [10], "compute_ms": -3.0}])]),
         "telemetry[1].microbatches[0].compute_ms", "greater than or equal to 0"),
        # Finite but beyond any measurement: two of them summed to inf, and the detector then flagged every
        # device at speed 0.001 (a 200).
        (json.dumps([_item(microbatches=[{"seq_lengths": [10], "compute_ms": 1e308}] * 2)]),
         "telemetry[0].microbatches[0].compute_ms", "less than or equal to 1000000000"),
        # NaN and Infinity are not JSON; they are refused at the field that holds them.
        ('[{"device": "0:0", "iteration": 1, "microbatches": [{"seq_lengths": [10], "compute_ms": NaN}], '
         '"last_heartbeat_s_ago": 0.1}]', "telemetry[0].microbatches[0].compute_ms", "finite number"),
        ('[{"device": "0:0", "iteration": 1, "microbatches": [], "last_heartbeat_s_ago": -Infinity}]',
         "telemetry[0].last_heartbeat_s_ago", "finite number"),
        ('[{"device": "0:0", "iteration": 1e999, "microbatches": [], "last_heartbeat_s_ago": 1}]',
         "telemetry[0].iteration", "finite number"),
        (json.dumps([_item(microbatches=[{"seq_lengths": [], "compute_ms": 1.0}])]),
         "telemetry[0].microbatches[0].seq_lengths", "at least 1 item"),
        (json.dumps([_item(device="0:*")]), "telemetry[0].device", "<node>:<gpu>"),
        (json.dumps([_item(colour="red")]), "telemetry[0].colour", "Extra inputs"),
        (json.dumps([_item(), 5]), "telemetry[1]", "valid dictionary"),
        (json.dumps([]), "telemetry", "at least 1 item"),
        (json.dumps({"a": 1}), "telemetry", "valid list"),
    ],
)
def test_a_bad_field_is_named_by_its_path(telemetry_json, field, fragment):
    error = _rejection(f'{{"plan_id": "p1", "telemetry": {telemetry_json}}}')
    assert fragment in _fields(error)[field], error.errors
    assert error.detail.startswith(f"{field}: ")


@pytest.mark.parametrize(
    ("body", "field", "fragment"),
    [
        (b"", None, "no body"),
        (b'{"plan_id": "\xff", "telemetry": []}', None, "not UTF-8 text (byte 13"),
        (b"[1, 2]", "", "JSON object"),
        (b"plan", "", "Invalid JSON: Expecting value (line 1, column 1)"),
        (b'{"plan_id": "p1",\n "telemetry": [{"device": "0:0",, }]}', "telemetry[0]", "(line 2, column 33)"),
        (b'{"plan_id": "p1", "telemetry": [' + json.dumps(_item()).encode() + b"]} trailing", "", "Extra data"),
        (b'{"plan_id": "p1", "telemetry": [' + json.dumps(_item()).encode() + b', "', "telemetry[1]",
         "Unterminated string"),
        (b'{"plan_id": "p1", "telemetry": [' + b"[" * 100_000 + b"]" * 100_000 + b"]}", "telemetry[0]",
         "nest too deeply"),
        (b'{"plan_id": "p1", "telemetry": [{"device": "0:0", "iteration": ' + b"9" * 5000 + b"}]}", "telemetry[0]",
         "4,300 digits"),
        (b'{"telemetry": [' + json.dumps(_item()).encode() + b"]}", "plan_id", "Field required"),
        (b'{"plan_id": "p1"}', "telemetry", "Field required"),
        (b'{"plan_id": 7, "telemetry": [' + json.dumps(_item()).encode() + b"]}", "plan_id", "valid string"),
        (b'{"plan_id": "' + b"a" * 65 + b'", "telemetry": [' + json.dumps(_item()).encode() + b"]}", "plan_id",
         "at most 64 characters"),
        (b'{"plan_id": "a", "plan_id": "b", "telemetry": [' + json.dumps(_item()).encode() + b"]}", "plan_id",
         "appears twice"),
        (b'{"plan_id": "a", "extra": 1, "telemetry": [' + json.dumps(_item()).encode() + b"]}", "extra",
         "Extra inputs"),
    ],
)
def test_a_malformed_body_is_a_clear_422(body, field, fragment):
    error = _rejection(body)
    if field is None:  # about the bytes, not a field
        assert error.errors == [] and fragment in error.detail
    else:
        assert fragment in _fields(error)[field], error.errors
        assert fragment in error.detail


def test_lone_surrogates_and_huge_keys_are_refused_without_being_echoed():
    device = _rejection('{"plan_id": "p1", "telemetry": [{"device": "\\ud800:0", "iteration": 1, '
                        '"microbatches": [], "last_heartbeat_s_ago": 1}]}')
    assert "telemetry[0].device" in _fields(device)
    plan_id = _rejection('{"plan_id": "\\udc00", "telemetry": [' + json.dumps(_item()) + "]}")
    assert "valid string" in _fields(plan_id)["plan_id"]
    key = _rejection('{"plan_id": "p1", "telemetry": [' + json.dumps(_item())[:-1] + ', "\\ud800bad": 1}]}')
    assert key.errors and key.errors[0]["field"].startswith("telemetry[0]")
    huge = "k" * 100_000
    long_key = _rejection(f'{{"plan_id": "p1", "{huge}": 1, "telemetry": [{json.dumps(_item())}]}}')
    assert list(_fields(long_key)) == ['"' + "k" * 32 + '..."']


def test_validation_stops_after_enough_problems_to_report():
    error = _rejection(_body([_item(iteration=-1) for _ in range(500)]))
    assert len(error.errors) == MAX_REPORTED_ERRORS
    assert [entry["field"] for entry in error.errors[:2]] == ["telemetry[0].iteration", "telemetry[1].iteration"]
    assert "more problems" in error.detail


def test_more_items_than_the_wire_allows_are_refused(monkeypatch):
    monkeypatch.setattr(api.tasks.telemetry_body, "MAX_TELEMETRY_ITEMS", 3)
    assert len(parse_detect_body(_body([_item(iteration=i) for i in range(3)])).telemetry) == 3
    error = _rejection(_body([_item(iteration=i) for i in range(4)]))
    assert _fields(error) == {"telemetry": "List should have at most 3 items"}


def test_the_error_crosses_the_process_boundary_whole():
    error = _rejection(_body([_item(iteration=-1)]))
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is BodyValidationError
    assert (copy.detail, copy.errors) == (error.detail, error.errors)


def test_every_problem_of_a_body_is_reported_together():
    error = _rejection(b'{"telemetry": [], "colour": 1}')
    assert _fields(error) == {
        "colour": "Extra inputs are not permitted",
        "plan_id": "Field required",
        "telemetry": "List should have at least 1 item after validation, not 0",
    }
