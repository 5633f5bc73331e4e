"""The command line on files and flags no user should send, each found by fuzzing as a traceback, a hang or a
nonsense answer: every one is now a one-line error on stderr and exit code 2."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from cli import build_parser, main
from tests.api.support import estimate_request, small_request
from tests.cli.test_cli import run_error, run_ok, write

MEGATRON = ("pretrain_gpt.py --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 "
            "--global-batch-size 16 --bf16 --vocab-size 32000")
HUGE_NUMBER = '{"runs": ' + "9" * 5000 + "}"
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(scope="module")
def stock_plan(tmp_path_factory) -> dict:
    """A stock plan as `resiplan plan` prints it, to edit by hand."""
    path = tmp_path_factory.mktemp("plan") / "request.json"
    path.write_text(json.dumps(small_request(options={"allow_non_uniform": False, "time_limit_s": 5})))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["plan", "--request", str(path)]) == 0
    return json.loads(printed.getvalue())


@pytest.mark.parametrize("text", [HUGE_NUMBER, DEEP])
@pytest.mark.parametrize("where", ["calibration", "cluster", "deepspeed"])
def test_side_files_json_cannot_read_name_the_file(tmp_path, capsys, text, where):
    bad = write(tmp_path, text, "bad.json")
    if where == "calibration":
        argv = ["plan", "--request", write(tmp_path, small_request()), "--calibration", bad]
    elif where == "cluster":
        argv = ["import", "megatron", write(tmp_path, MEGATRON, "run.sh"), "--cluster", bad]
    else:
        argv = ["import", "deepspeed", bad, "--megatron-args", write(tmp_path, MEGATRON, "run.sh")]
    assert bad in run_error(capsys, argv)


@pytest.mark.parametrize(("name", "value"), [("gemm_peak_fraction", -1.0), ("gemm_peak_fraction", 0.0),
                                             ("attention_fraction", 0.0), ("layer_overhead_ms", 1e308)])
def test_a_hand_edited_calibration_outside_a_fits_range_is_refused(tmp_path, capsys, name, value):
    """Was a plan with a negative iteration time, a ZeroDivisionError, or a NaN layer split."""
    request = estimate_request({"tp": 1, "pp": 2, "micro_batch_size": 1, "recompute": "none", "schedule": "1f1b"})
    plain = json.loads(run_ok(capsys, ["estimate", "--request", write(tmp_path, request)]))
    runs = {"name": "cli", "runs": [{**request, "measured_iteration_time_s": plain["predicted"]["iteration_time_s"]}]}
    calibration = json.loads(run_ok(capsys, ["calibrate", "--runs", write(tmp_path, runs, "runs.json")]))
    calibration["parameters"][name] = value
    path = write(tmp_path, calibration, "calibration.json")
    err = run_error(capsys, ["estimate", "--request", write(tmp_path, request), "--calibration", path])
    assert f"parameters.{name}" in err and "a calibration's" in err


@pytest.mark.parametrize(("edit", "named"), [
    (lambda plan: plan.update(replicas=[]), "no replicas"),
    (lambda plan: [replica.update(stages=[]) for replica in plan["replicas"]], "has no stages"),
    (lambda plan: plan["replicas"][0]["stages"][0].update(tp=0), "tp 0 and cp 1 must be at least 1"),
    (lambda plan: plan.update(virtual_stages=0), "virtual_stages 0 must be at least 1"),
    (lambda plan: plan.update(zero_stage=5), "zero_stage 5 is not a ZeRO stage"),
    (lambda plan: plan["replicas"][0].update(num_microbatches=10**12), "num_microbatches 1000000000000"),
    (lambda plan: plan["replicas"][0]["stages"][0].update(layers=[0, 10**9]), "is not a range of the model's"),
])
@pytest.mark.parametrize("format_name", ["megatron", "deepspeed", "torchtitan", "torch-csv"])
def test_a_hand_edited_plan_is_refused_before_export(tmp_path, capsys, stock_plan, edit, named, format_name):
    plan = json.loads(json.dumps(stock_plan))
    edit(plan)
    assert named in run_error(capsys, ["export", "--format", format_name, write(tmp_path, plan, "plan.json")])


def test_the_unedited_plan_still_exports(tmp_path, capsys, stock_plan):
    assert run_ok(capsys, ["export", "--format", "megatron", write(tmp_path, stock_plan, "plan.json")])


@pytest.mark.parametrize(("flag", "value"), [("--norm-epsilon", "nan"), ("--norm-epsilon", "-1"),
                                             ("--norm-epsilon", "1e999")])
def test_megatron_numbers_that_are_not_finite_and_positive_are_named(tmp_path, capsys, flag, value):
    """Was JSON with NaN or Infinity in it, exit 0."""
    err = run_error(capsys, ["import", "megatron", write(tmp_path, f"{MEGATRON} {flag} {value}", "run.sh")])
    assert f"{flag} {value} must be a finite number above 0" in err


def test_rope_numbers_are_checked_too(tmp_path, capsys):
    line = f"{MEGATRON} --position-embedding-type rope --rotary-base inf"
    assert "--rotary-base inf must be a finite number" in run_error(
        capsys, ["import", "megatron", write(tmp_path, line, "run.sh")])


def test_a_token_http_cannot_carry_is_refused_before_connecting(tmp_path, capsys):
    request = write(tmp_path, small_request())
    err = run_error(capsys, ["launch", "--format", "megatron", "--request", request, "--token", "é",
                             "--server", "http://127.0.0.1:9"])
    assert "printable ASCII" in err


@pytest.mark.parametrize("argv", [["serve", "--port", "99999"], ["serve", "--port", "-1"],
                                  ["serve", "--log-level", "bogus"]])
def test_serve_flags_out_of_range_are_usage_errors(capsys, argv):
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(argv)
    assert stop.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_an_output_that_cannot_be_written_is_named_as_written_not_read(tmp_path, capsys, stock_plan):
    err = run_error(capsys, ["export", "--format", "megatron", "-o", str(tmp_path),
                             write(tmp_path, stock_plan, "plan.json")])
    assert f"cannot write {tmp_path}" in err


def test_a_calibration_file_that_is_not_utf8_is_named_not_the_request(tmp_path, capsys):
    bad = tmp_path / "calibration.json"
    bad.write_bytes(b'{"name": "\xe9"}')
    err = run_error(capsys, ["plan", "--request", write(tmp_path, small_request()), "--calibration", str(bad)])
    assert f"{bad} is not UTF-8 text" in err


def test_a_calibration_body_with_roles_says_the_cli_fits_runs_only(tmp_path, capsys):
    roles = {"name": "job", "roles": [{"plan_id": "0" * 32, "time_models": []}]}
    err = run_error(capsys, ["plan", "--request", write(tmp_path, small_request()), "--calibration",
                             write(tmp_path, roles, "roles.json")])
    assert "fits runs only" in err and "POST /v1/calibrations" in err
