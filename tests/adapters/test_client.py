"""PlannerClient against the real service (uvicorn in a thread) and a scripted transport; `resiplan launch`."""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from adapters import registry
from adapters.client import SOLVE_MARGIN_S, PlannerClient, PlannerError
from adapters.registry import ExportError, ExportFormat
from api.app import create_app
from api.tasks.planning import plan_for
from cli import main
from tests.api.support import small_request, verify_plan
from tests.live_server import closed_port, live_server
from wire.schemas import Failures, Options, Plan, PlanRequest

STOCK_REQUEST = small_request(options={"time_limit_s": 2, "allow_non_uniform": False})
INFEASIBLE_REQUEST = small_request(
    cluster={"num_nodes": 1, "gpus_per_node": 8, "gpu": "A100-80GB"}, model="llama3-405b"
)
BASE = "http://planner.test"


# ---------------------------------------------------------------------------------------------------------------
# The real service


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """(base URL, Authorization headers seen): the app under uvicorn, recording each request's bearer header."""
    from api.core.settings import Settings

    app = create_app(Settings(database_url=f"sqlite:///{tmp_path_factory.mktemp('client-db')}/plans.db"))
    authorizations: list[str | None] = []

    async def recording(scope, receive, send):
        if scope["type"] == "http":
            value = dict(scope["headers"]).get(b"authorization")
            authorizations.append(value.decode() if value is not None else None)
        await app(scope, receive, send)

    with live_server(recording) as base_url:
        yield base_url, authorizations


@pytest.fixture(scope="module")
def base_url(service) -> str:
    return service[0]


@pytest.fixture(scope="module")
def planned(base_url) -> Plan:
    with PlannerClient(base_url, retries=0) as client:
        return client.plan(STOCK_REQUEST)


def test_plan_is_a_validated_plan_meeting_the_invariants(planned):
    assert isinstance(planned, Plan)
    verify_plan(planned.model_dump(mode="json"), STOCK_REQUEST)
    assert planned.uniform is True
    assert planned.schedule in {"gpipe", "1f1b", "interleaved"}


def test_get_returns_the_same_plan(base_url, planned):
    with PlannerClient(base_url) as client:
        assert client.get(planned.plan_id) == planned


def test_export_torch_csv_is_csv_text(base_url, planned):
    with PlannerClient(base_url) as client:
        text = client.export(planned.plan_id, "torch-csv", replica=0)
    rows = text.strip().splitlines()
    assert len(rows) == len(planned.replicas[0].stages)
    assert rows[0].split(",")[0] == "0F0"


def test_infeasible_request_raises_the_servers_detail(base_url):
    with PlannerClient(base_url, retries=3, sleep=_no_sleep) as client, pytest.raises(PlannerError) as raised:
        client.plan(INFEASIBLE_REQUEST)
    error = raised.value
    assert error.status_code == 422
    assert "llama3-405b needs at least" in error.detail
    assert "616 GiB" in error.detail
    assert error.detail in str(error)
    assert "\n" not in str(error)


def test_unknown_plan_and_format_are_404(base_url, planned):
    with PlannerClient(base_url, sleep=_no_sleep) as client:
        with pytest.raises(PlannerError, match="no plan with id 'nope'") as raised:
            client.get("nope")
        assert raised.value.status_code == 404
        with pytest.raises(PlannerError, match="unknown export format 'excel'"):
            client.export(planned.plan_id, "excel")


# ---------------------------------------------------------------------------------------------------------------
# A scripted transport


def _no_sleep(seconds: float) -> None:
    raise AssertionError(f"unexpected sleep({seconds})")


@pytest.fixture(scope="module")
def plan_json() -> dict:
    return plan_for(PlanRequest.model_validate(STOCK_REQUEST)).model_dump(mode="json")


Step = httpx.Response | Exception | Callable[[httpx.Request], httpx.Response]


class Script:
    """A MockTransport answering with the given steps in order (the last one repeats), recording requests."""

    def __init__(self, *steps: Step) -> None:
        self.steps = list(steps)
        self.requests: list[httpx.Request] = []
        self.sleeps: list[float] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        step = self.steps[min(len(self.requests), len(self.steps)) - 1]
        if isinstance(step, Exception):
            raise step
        return step(request) if callable(step) else step

    def client(self, **kwargs) -> PlannerClient:
        kwargs.setdefault("jitter", 0.0)
        return PlannerClient(BASE, transport=httpx.MockTransport(self), sleep=self.sleeps.append, **kwargs)


def busy(**headers) -> httpx.Response:
    return httpx.Response(503, json={"detail": "busy solving"}, headers=headers)


def test_503_is_retried_honouring_retry_after(plan_json):
    script = Script(busy(), busy(**{"Retry-After": "7"}), busy(), httpx.Response(200, json=plan_json))
    with script.client(retries=4, backoff_s=0.5) as client:
        plan = client.plan(STOCK_REQUEST)
    assert plan.plan_id == plan_json["plan_id"]
    assert len(script.requests) == 4
    assert script.sleeps == [0.5, 7.0, 2.0]


def test_backoff_grows_exponentially_capped_then_gives_up():
    script = Script(busy())
    with script.client(retries=6, backoff_s=0.5, max_backoff_s=4.0) as client, pytest.raises(PlannerError) as raised:
        client.get("abc")
    assert script.sleeps == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert len(script.requests) == 7
    assert raised.value.status_code == 503
    assert raised.value.detail == "busy solving"
    assert "after 7 attempts" in str(raised.value)


@pytest.mark.parametrize(
    ("retry_after", "expected"),
    [("3600", 30.0), ("0", 0.0), ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0), ("soon", 0.5), ("-5", 0.0)],
)
def test_retry_after_is_capped_and_read_as_seconds_or_a_date(plan_json, retry_after, expected):
    script = Script(busy(**{"Retry-After": retry_after}), httpx.Response(200, json=plan_json))
    with script.client(backoff_s=0.5, max_backoff_s=30.0) as client:
        client.get("abc")
    assert script.sleeps == [expected]


def test_jitter_comes_from_the_injected_rng_and_stays_small():
    def delays(seed: int) -> list[float]:
        script = Script(busy())
        client = script.client(retries=3, backoff_s=1.0, jitter=0.1, rng=random.Random(seed))
        with client, pytest.raises(PlannerError):
            client.get("abc")
        return script.sleeps

    first = delays(7)
    assert first == delays(7)
    assert first != delays(8)
    for delay, base in zip(first, [1.0, 2.0, 4.0], strict=True):
        assert base <= delay <= base * 1.1


def test_connection_errors_are_retried(plan_json):
    refused = httpx.ConnectError("[Errno 111] Connection refused")
    script = Script(refused, httpx.ConnectTimeout("timed out"), httpx.Response(200, json=plan_json))
    with script.client(backoff_s=0.25) as client:
        plan = client.plan(STOCK_REQUEST)
    assert plan.plan_id == plan_json["plan_id"]
    assert script.sleeps == [0.25, 0.5]


def test_unreachable_gives_up_after_retries_with_a_clear_error():
    script = Script(httpx.ConnectError("[Errno 111] Connection refused"))
    with script.client(retries=2) as client, pytest.raises(PlannerError) as raised:
        client.plan(STOCK_REQUEST)
    assert len(script.requests) == 3
    assert len(script.sleeps) == 2
    assert raised.value.status_code is None
    assert str(raised.value) == (
        f"cannot reach the planner at {BASE}: [Errno 111] Connection refused (tried 3 times)"
    )


def test_a_post_that_timed_out_waiting_for_the_answer_is_not_repeated():
    script = Script(httpx.ReadTimeout("read timed out"))
    with script.client(retries=4) as client, pytest.raises(PlannerError, match="may still be solving"):
        client.plan(STOCK_REQUEST)
    assert len(script.requests) == 1


def test_a_get_that_lost_its_connection_is_repeated(plan_json):
    script = Script(httpx.ReadTimeout("read timed out"), httpx.RemoteProtocolError("closed"),
                    httpx.Response(200, json=plan_json))
    with script.client() as client:
        client.get("abc")
    assert len(script.requests) == 3


@pytest.mark.parametrize("status", [400, 401, 403, 404, 409, 422, 429, 500])
def test_client_errors_and_500_are_never_retried(status):
    script = Script(httpx.Response(status, json={"detail": f"nope {status}"}, headers={"Retry-After": "1"}))
    with script.client(retries=4) as client, pytest.raises(PlannerError) as raised:
        client.plan(STOCK_REQUEST)
    assert len(script.requests) == 1
    assert script.sleeps == []
    assert raised.value.status_code == status
    assert raised.value.detail == f"nope {status}"
    assert f"(HTTP {status}" in str(raised.value)


@pytest.mark.parametrize("status", [502, 504])
def test_gateway_errors_are_retried(plan_json, status):
    script = Script(httpx.Response(status, text="<html>bad gateway</html>"), httpx.Response(200, json=plan_json))
    with script.client() as client:
        client.get("abc")
    assert len(script.requests) == 2


def test_validation_errors_read_as_one_line():
    detail = [
        {"type": "missing", "loc": ["body", "training", "seq_length"], "msg": "Field required"},
        {"type": "value_error", "loc": ["body", "cluster", "num_nodes"], "msg": "Input should be >= 1"},
    ]
    script = Script(httpx.Response(422, json={"detail": detail}))
    with script.client() as client, pytest.raises(PlannerError) as raised:
        client.get("abc")
    assert raised.value.detail == "training.seq_length: Field required; cluster.num_nodes: Input should be >= 1"


def test_an_answer_that_is_not_a_plan_is_an_error():
    script = Script(httpx.Response(200, json={"hello": "world"}))
    with script.client() as client, pytest.raises(PlannerError, match="not a Plan"):
        client.get("abc")


def test_bearer_token_is_sent_only_when_given(plan_json):
    with_token = Script(httpx.Response(200, json=plan_json))
    with with_token.client(token="s3cret") as client:
        client.get("abc")
        client.export("abc", "json")
    assert [r.headers["Authorization"] for r in with_token.requests] == ["Bearer s3cret"] * 2
    without = Script(httpx.Response(200, json=plan_json))
    with without.client() as client:
        client.get("abc")
    assert "Authorization" not in without.requests[0].headers


def test_plan_waits_for_the_solve_plus_a_margin(plan_json):
    script = Script(httpx.Response(200, json=plan_json))
    long_solve = small_request(options={"time_limit_s": 600})
    with script.client(timeout_s=5.0, connect_timeout_s=2.0) as client:
        client.plan(STOCK_REQUEST)
        client.plan(long_solve)
        client.get("abc")
    reads = [r.extensions["timeout"]["read"] for r in script.requests]
    assert reads == [2 + SOLVE_MARGIN_S, 600 + SOLVE_MARGIN_S, 5.0]
    assert {r.extensions["timeout"]["connect"] for r in script.requests} == {2.0}


def test_plan_posts_the_request_as_given(plan_json):
    script = Script(httpx.Response(200, json=plan_json))
    with script.client() as client:
        client.plan(PlanRequest.model_validate(STOCK_REQUEST))
    request = script.requests[0]
    assert (request.method, str(request.url)) == ("POST", f"{BASE}/v1/plan")
    assert json.loads(request.content) == STOCK_REQUEST  # unset fields are left to the server's defaults


def test_a_malformed_request_fails_before_the_network():
    script = Script(AssertionError("sent"))
    with script.client() as client, pytest.raises(ValidationError):
        client.plan({"cluster": {"num_nodes": 0}})
    assert script.requests == []


def test_replan_posts_failures_and_options_per_api_md(plan_json):
    child = {**plan_json, "plan_id": "child", "parent_plan_id": "p/1",
             "migration": {"bytes_moved": 123, "devices_changed": ["0:3"], "estimated_s": 1.5}}
    script = Script(httpx.Response(200, json=child))
    failures = {"failed": ["0:3", "1:*"], "slow": [{"device": "1:2", "speed": 0.5}]}
    with script.client(timeout_s=5.0) as client:
        plan = client.replan("p/1", failures, {"time_limit_s": 20, "allow_non_uniform": False})
        client.replan("p/1", Failures(failed=["0:3"]))
        client.replan("p/1", Failures(), Options(random_seed=3))
    assert plan.parent_plan_id == "p/1"
    assert plan.migration.bytes_moved == 123
    first, second, third = script.requests
    assert first.method == "POST"
    assert first.url.raw_path == b"/v1/plans/p%2F1/replan"
    options = {"time_limit_s": 20, "allow_non_uniform": False}
    assert json.loads(first.content) == {"failures": failures, "options": options}
    assert first.extensions["timeout"]["read"] == 20 + SOLVE_MARGIN_S
    assert json.loads(second.content) == {"failures": {"failed": ["0:3"], "slow": []}}
    assert second.extensions["timeout"]["read"] == 5.0
    assert json.loads(third.content) == {"failures": {"failed": [], "slow": []}, "options": {"random_seed": 3}}


def test_export_asks_for_a_replica_and_returns_text():
    script = Script(httpx.Response(200, text="0F0,0B0\n", headers={"Content-Type": "text/csv"}))
    with script.client() as client:
        assert client.export("abc", "torch-csv", replica=3) == "0F0,0B0\n"
        client.export("abc", "svg")
    assert str(script.requests[0].url) == f"{BASE}/v1/plans/abc/export/torch-csv?replica=3"
    assert str(script.requests[1].url) == f"{BASE}/v1/plans/abc/export/svg"


def test_base_url_may_carry_a_path_prefix(plan_json):
    script = Script(httpx.Response(200, json=plan_json))
    with PlannerClient(f"{BASE}/resiplan/", transport=httpx.MockTransport(script)) as client:
        client.get("abc")
    assert str(script.requests[0].url) == f"{BASE}/resiplan/v1/plans/abc"


def test_an_injected_http_client_is_used_and_left_open(plan_json):
    script = Script(httpx.Response(200, json=plan_json))
    http = httpx.Client(transport=httpx.MockTransport(script))
    with PlannerClient(BASE, http=http) as client:
        client.get("abc")
    assert not http.is_closed
    http.close()
    own = PlannerClient(BASE, transport=httpx.MockTransport(script))
    own.close()
    assert own._http.is_closed


# ---------------------------------------------------------------------------------------------------------------
# resiplan launch


def launch_command(plan: Plan) -> str:
    """A trivial trainer for the `launch` plumbing: the real ones live in adapters.{megatron,deepspeed,torchtitan}."""
    stages = plan.replicas[0].stages
    return (f"torchrun --nproc-per-node {len(stages[0].devices)} train.py --plan-id {plan.plan_id} "
            f"--tp {stages[0].tp} --pp {len(stages)} --dp {len(plan.replicas)}")


@pytest.fixture
def fake_trainer(monkeypatch) -> str:
    fake = ExportFormat("fake-trainer", "text/plain", ".txt", __name__, "test trainer")
    monkeypatch.setattr(registry, "FORMATS", (*registry.FORMATS, fake))
    return fake.name


def write_request(tmp_path: Path, body: dict) -> str:
    path = tmp_path / "request.json"
    path.write_text(json.dumps(body))
    return str(path)


def launch(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["launch", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def test_launch_prints_the_trainers_command(tmp_path, capsys, monkeypatch, service, fake_trainer):
    base_url, authorizations = service
    monkeypatch.setenv("RESIPLAN_API_TOKEN", "from-env")
    body = small_request(options={"time_limit_s": 2})  # no allow_non_uniform: launch asks for a stock plan
    seen = len(authorizations)
    code, out, err = launch(capsys, "--format", fake_trainer, "--request", write_request(tmp_path, body),
                            "--server", base_url)
    assert code == 0, err
    assert authorizations[seen:] == ["Bearer from-env"]
    info = err.strip().splitlines()
    assert len(info) == 1 and info[0].startswith("resiplan: plan ")
    plan_id = info[0].split()[2]
    assert f"{base_url}/v1/plans/{plan_id}" in info[0]
    with PlannerClient(base_url) as client:
        plan = client.get(plan_id)
    assert plan.uniform
    assert out == launch_command(plan) + "\n"

    code, _, err = launch(capsys, "--format", fake_trainer, "--request", write_request(tmp_path, body),
                          "--server", base_url, "--token", "from-flag")
    assert code == 0, err
    assert authorizations[-1] == "Bearer from-flag"


def test_launch_when_the_service_is_unreachable(tmp_path, capsys, fake_trainer):
    server = f"http://127.0.0.1:{closed_port()}"
    code, out, err = launch(capsys, "--format", fake_trainer, "--request", write_request(tmp_path, STOCK_REQUEST),
                            "--server", server, "--retries", "0")
    assert (code, out) == (2, "")
    assert err.startswith(f"resiplan: cannot reach the planner at {server}: ")
    assert err.count("\n") == 1


def test_launch_prints_the_servers_refusal(tmp_path, capsys, base_url, fake_trainer):
    code, out, err = launch(capsys, "--format", fake_trainer, "--request", write_request(tmp_path, INFEASIBLE_REQUEST),
                            "--server", base_url)
    assert (code, out) == (2, "")
    assert err.startswith("resiplan: the planner refused POST /v1/plan (HTTP 422): llama3-405b needs at least")
    assert err.count("\n") == 1


def test_launch_of_a_plan_the_trainer_cannot_run(tmp_path, capsys, monkeypatch, base_url, fake_trainer):
    def refuse(plan: Plan) -> str:
        raise ExportError(f"this trainer cannot run plan {plan.plan_id}")

    monkeypatch.setattr(sys.modules[__name__], "launch_command", refuse)
    code, out, err = launch(capsys, "--format", fake_trainer, "--request", write_request(tmp_path, STOCK_REQUEST),
                            "--server", base_url)
    assert (code, out) == (2, "")
    info, refusal = err.strip().splitlines()
    assert info.startswith("resiplan: plan ")
    assert refusal == f"resiplan: this trainer cannot run plan {info.split()[2]}"


@pytest.mark.parametrize(
    ("trainer", "message"),
    [("excel", "unknown trainer 'excel'; launch works with: megatron, deepspeed, torchtitan"),
     ("json", "format 'json' has no launch command")],
)
def test_launch_checks_the_trainer_before_asking_for_a_plan(tmp_path, capsys, trainer, message):
    server = f"http://127.0.0.1:{closed_port()}"  # never contacted: the format error comes first
    code, out, err = launch(capsys, "--format", trainer, "--request", write_request(tmp_path, STOCK_REQUEST),
                            "--server", server, "--retries", "0")
    assert (code, out) == (2, "")
    assert err.startswith(f"resiplan: {message}")


def test_launch_rejects_an_invalid_request_locally(tmp_path, capsys, fake_trainer):
    server = f"http://127.0.0.1:{closed_port()}"
    code, out, err = launch(capsys, "--format", fake_trainer, "--request", write_request(tmp_path, {"model": 1}),
                            "--server", server)
    assert (code, out) == (2, "")
    assert err.startswith("resiplan: invalid request:")


@pytest.mark.parametrize("trainer", ["megatron", "deepspeed", "torchtitan"])
def test_launch_with_a_real_trainer(tmp_path, capsys, base_url, trainer):
    code, out, err = launch(capsys, "--format", trainer, "--request", write_request(tmp_path, STOCK_REQUEST),
                            "--server", base_url)
    assert code == 0, err
    assert out.strip() and out.endswith("\n")
