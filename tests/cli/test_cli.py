"""The `resiplan` command line: plan, estimate, and its error handling (exit code 2, message on stderr)."""

from __future__ import annotations

import io
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli import main
from tests.api.support import EXAMPLES_DIR, estimate_request, small_request, verify_plan
from wire.schemas import Plan


def write(tmp_path: Path, body, name: str = "request.json") -> str:
    path = tmp_path / name
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    return str(path)


def run_ok(capsys, argv) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert err == ""
    return out


def run_error(capsys, argv) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert err.startswith("resiplan: ")
    assert "Traceback" not in err
    return err


def test_plan_prints_plan_json(tmp_path, capsys):
    body = small_request(failures={"failed": ["0:3"], "slow": [{"device": "1:1", "speed": 0.5}]})
    out = run_ok(capsys, ["plan", "--request", write(tmp_path, body)])
    plan = verify_plan(json.loads(out), body)
    assert plan.excluded_devices == ["0:3"]
    assert plan.model == "llama2-7b"


def test_plan_sample_scenario(capsys):
    path = EXAMPLES_DIR / "healthy-32xa100-llama2-7b.json"
    out = run_ok(capsys, ["plan", "--request", str(path)])
    verify_plan(json.loads(out), json.loads(path.read_text()))


def test_plan_from_stdin(capsys, monkeypatch):
    body = small_request()
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(body)))
    out = run_ok(capsys, ["plan", "--request", "-"])
    verify_plan(json.loads(out), body)


def test_plan_table_format(tmp_path, capsys):
    out = run_ok(capsys, ["plan", "--request", write(tmp_path, small_request()), "--format", "table"])
    assert "iteration" in out
    assert "MFU" in out
    assert "llama2-7b" in out
    assert "tokens/s" in out
    with pytest.raises(json.JSONDecodeError):
        json.loads(out)


def test_estimate_prints_the_fixed_layout(tmp_path, capsys):
    body = estimate_request({"tp": 2, "pp": 2})
    out = run_ok(capsys, ["estimate", "--request", write(tmp_path, body)])
    plan = verify_plan(json.loads(out), body)
    assert plan.uniform is True
    assert len(plan.replicas) == 8
    for replica in plan.replicas:
        assert [s.tp for s in replica.stages] == [2, 2]
        assert [tuple(s.layers) for s in replica.stages] == [(0, 16), (16, 32)]


def test_estimate_table_format(tmp_path, capsys):
    out = run_ok(capsys, ["estimate", "--request", write(tmp_path, estimate_request({"tp": 2, "pp": 2})), "--format", "table"])
    assert "iteration" in out and "MFU" in out
    assert "[0, 16)" in out and "[16, 32)" in out


def test_the_table_names_uneven_model_chunks(tmp_path, capsys):
    layout = {"tp": 1, "pp": 4, "virtual_stages": 2, "schedule": "interleaved", "recompute": "selective",
              "layers_per_chunk": [3, 4, 4, 5, 5, 4, 4, 3]}
    out = run_ok(capsys, ["estimate", "--request", write(tmp_path, estimate_request(layout)), "--format", "table"])
    assert "[0, 8) chunks 3+5" in out and "[24, 32) chunks 5+3" in out and "chunks 4+4" in out


def test_missing_file(tmp_path, capsys):
    missing = str(tmp_path / "nope.json")
    err = run_error(capsys, ["plan", "--request", missing])
    assert "cannot read" in err and "nope.json" in err


def test_invalid_json(tmp_path, capsys):
    err = run_error(capsys, ["plan", "--request", write(tmp_path, '{"cluster": ')])
    assert "json" in err.lower()
    assert "invalid" in err.lower() or "not JSON" in err


def test_validation_error_names_the_field(tmp_path, capsys):
    body = small_request(training={"global_batch_size": 0, "seq_length": 2048})
    err = run_error(capsys, ["plan", "--request", write(tmp_path, body)])
    assert "invalid request" in err
    assert "training.global_batch_size" in err
    assert "greater than or equal to 1" in err


def test_unknown_field_is_rejected(tmp_path, capsys):
    err = run_error(capsys, ["plan", "--request", write(tmp_path, small_request(optionz={}))])
    assert "optionz" in err and "Extra inputs are not permitted" in err


def test_infeasible_request(tmp_path, capsys):
    body = small_request(model="llama3-405b", cluster={"num_nodes": 1, "gpus_per_node": 8, "gpu": "A100-80GB"})
    err = run_error(capsys, ["plan", "--request", write(tmp_path, body)])
    assert "TiB" in err and "8 surviving" in err


def test_unknown_preset(tmp_path, capsys):
    err = run_error(capsys, ["plan", "--request", write(tmp_path, small_request(model="gpt5"))])
    assert "unknown model preset 'gpt5'" in err and "llama2-7b" in err


def test_device_out_of_range(tmp_path, capsys):
    err = run_error(capsys, ["plan", "--request", write(tmp_path, small_request(failures={"failed": ["5:0"]}))])
    assert "'5:0'" in err and "0..1" in err


def test_estimate_without_layout(tmp_path, capsys):
    err = run_error(capsys, ["estimate", "--request", write(tmp_path, small_request())])
    assert "layout" in err and "Field required" in err


def test_estimate_bad_layout(tmp_path, capsys):
    err = run_error(capsys, ["estimate", "--request", write(tmp_path, estimate_request({"tp": 3, "pp": 2}))])
    assert "tp 3" in err and "attention heads" in err


def test_estimate_layout_out_of_memory(tmp_path, capsys):
    body = estimate_request({"tp": 1, "pp": 1, "dp": 16, "micro_batch_size": 16, "recompute": "none"})
    err = run_error(capsys, ["estimate", "--request", write(tmp_path, body)])
    assert "GiB" in err


def test_request_that_is_a_directory(tmp_path, capsys):
    """An unreadable path is a bad request (exit 2 and a message), not a traceback."""
    err = run_error(capsys, ["plan", "--request", str(tmp_path)])
    assert str(tmp_path) in err or "cannot read" in err


def test_request_that_is_not_utf8(tmp_path, capsys):
    path = tmp_path / "binary.json"
    path.write_bytes(b"\xff\xfe\x00{")
    err = run_error(capsys, ["plan", "--request", str(path)])
    assert "binary.json" in err or "UTF-8" in err.upper() or "json" in err.lower()


def test_hf_config_with_overflowing_number(tmp_path, capsys):
    """1e400 is valid JSON; it must be reported as a bad request, not crash the command."""
    body = json.dumps(small_request(model={"hf_config": {"num_hidden_layers": 4, "hidden_size": 512,
                                                           "num_attention_heads": 8, "vocab_size": 1000}}))
    body = body.replace('"num_hidden_layers": 4', '"num_hidden_layers": 1e400')
    err = run_error(capsys, ["plan", "--request", write(tmp_path, body)])
    assert "hf_config" in err or "num_hidden_layers" in err


def test_usage_error_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan"])
    assert exit_info.value.code == 2
    assert "--request" in capsys.readouterr().err


def _console_script() -> str:
    candidate = Path(sys.executable).parent / "resiplan"
    found = str(candidate) if candidate.exists() else shutil.which("resiplan")
    assert found, "console script resiplan is not installed"
    return found


def test_console_script_plan(tmp_path):
    body = small_request()
    result = subprocess.run([_console_script(), "plan", "--request", write(tmp_path, body)],
                            capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    plan = Plan.model_validate_json(result.stdout)
    verify_plan(plan.model_dump(mode="json"), body)


def test_console_script_error_exit_code(tmp_path):
    result = subprocess.run([_console_script(), "plan", "--request", str(tmp_path / "absent.json")],
                            capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert result.stdout == ""
    assert "resiplan: cannot read" in result.stderr and "absent.json" in result.stderr


def test_the_table_is_not_wrapped_at_80_columns_when_piped(tmp_path):
    """Piped into a file there is no terminal width to fit: each line of the summary stays one line."""
    result = subprocess.run([_console_script(), "plan", "--request", write(tmp_path, small_request()),
                             "--format", "table"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    first = result.stdout.splitlines()[0]
    assert first.startswith("llama2-7b") and "recompute=" in first and len(first) > 80, first
    assert "iteration" in result.stdout.splitlines()[1]


def test_the_table_prints_a_plans_text_as_text(tmp_path, capsys):
    """A plan file is data: rich markup and terminal control sequences in its model name are printed inert."""
    planned = run_ok(capsys, ["plan", "--request", write(tmp_path, small_request())])
    hostile = json.loads(planned) | {"model": "[bold red]x[/bold red]\x1b]0;owned\x07[link=file:///etc]y"}
    out = run_ok(capsys, ["export", "--format", "json", write(tmp_path, hostile, "plan.json")])
    assert json.loads(out)["model"] == hostile["model"]
    from rich.console import Console

    from render.table import render_table
    from wire.schemas import Plan as WirePlan

    console = Console(file=io.StringIO(), width=200, force_terminal=True, color_system=None)
    render_table(WirePlan.model_validate(hostile), console)
    text = console.file.getvalue()
    assert "[bold red]x[/bold red]" in text and "[link=file:///etc]y" in text
    assert "\x1b]" not in text and "\x07" not in text


def test_import_megatron_then_estimate(tmp_path, capsys):
    """`resiplan import megatron` prints a request `resiplan estimate` takes once the cluster is given."""
    command = ("torchrun --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 2 "
               "--pipeline-model-parallel-size 2 --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 "
               "--num-attention-heads 32 --swiglu --untie-embeddings-and-output-weights --normalization RMSNorm "
               "--position-embedding-type rope --disable-bias-linear --seq-length 4096 --micro-batch-size 1 "
               "--global-batch-size 64 --recompute-granularity selective --use-distributed-optimizer --bf16 "
               "--sequence-parallel --overlap-grad-reduce --overlap-param-gather --lr 3e-4")
    cluster = write(tmp_path, {"num_nodes": 1, "gpus_per_node": 8, "gpu": "A100-80GB"}, "cluster.json")
    out = run_ok(capsys, ["import", "megatron", write(tmp_path, command, "run.sh"), "--cluster", cluster])
    imported = json.loads(out)
    assert imported["request"]["layout"]["dp"] == 2 and imported["request"]["model"]["vocab_size"] == 32000
    assert "--lr" in imported["ignored"] and imported["not_modelled"] == []
    assert any("llama2-7b" in note for note in imported["notes"]), "the vocabulary comes from the preset of that shape"
    plan = json.loads(run_ok(capsys, ["estimate", "--request", write(tmp_path, imported["request"])]))
    assert plan["status"] == "fixed" and len(plan["replicas"]) == 2


def test_import_of_an_incomplete_command_line(tmp_path, capsys):
    err = run_error(capsys, ["import", "megatron", write(tmp_path, "pretrain_gpt.py --num-layers 2", "run.sh")])
    assert "the command line has no --num-attention-heads" in err


def test_calibrate_prints_a_calibration_that_estimate_applies(tmp_path, capsys):
    layout = {"tp": 1, "pp": 2, "micro_batch_size": 1, "recompute": "none", "schedule": "1f1b"}
    request = estimate_request(layout)
    plain = json.loads(run_ok(capsys, ["estimate", "--request", write(tmp_path, request)]))
    measured = plain["predicted"]["iteration_time_s"] * 1.2
    runs = {"name": "cli", "runs": [{**request, "measured_iteration_time_s": measured}]}
    calibration = json.loads(run_ok(capsys, ["calibrate", "--runs", write(tmp_path, runs, "runs.json")]))
    # One run 20% off: the calibration takes most of the move to it (fit_weight), not all.
    assert calibration["fit_weight"] == pytest.approx(1 - (0.079 / math.log(1.2)) ** 2, abs=0.02)
    predicted = calibration["runs"][0]["predicted_s"]
    assert calibration["fitted"] and plain["predicted"]["iteration_time_s"] < predicted < measured
    assert predicted == pytest.approx(measured, rel=0.05)
    path = write(tmp_path, calibration, "calibration.json")
    calibrated = json.loads(run_ok(capsys, ["estimate", "--request", write(tmp_path, request), "--calibration", path]))
    assert calibrated["predicted"]["calibration_id"] == calibration["calibration_id"]
    assert calibrated["predicted"]["iteration_time_s"] == pytest.approx(predicted, rel=1e-5)  # parameters: 6 decimals
    # A request naming another calibration than the file's is refused.
    other = {**request, "options": {"calibration_id": "0" * 32}}
    assert "calibration_id" in run_error(capsys, ["estimate", "--request", write(tmp_path, other), "--calibration", path])
    bad = {"name": "cli", "runs": [{**request, "layout": {**layout, "tp": 3}, "measured_iteration_time_s": 1.0}]}
    assert "runs[0]" in run_error(capsys, ["calibrate", "--runs", write(tmp_path, bad, "bad.json")])

    # The runs file itself is fitted there and then, under the running version's cost model.
    runs_path = write(tmp_path, runs, "runs.json")
    fitted_now = json.loads(run_ok(capsys, ["estimate", "--request", write(tmp_path, request), "--calibration",
                                            runs_path]))
    assert fitted_now["predicted"]["iteration_time_s"] == pytest.approx(predicted, rel=1e-5)
    assert fitted_now["predicted"]["calibration_id"] not in (None, calibration["calibration_id"])
    # A calibration fitted by an earlier version applies as printed: its parameters, not this model's fit.
    earlier = {**calibration, "parameters": calibration["default_parameters"]}
    as_printed = json.loads(run_ok(capsys, ["estimate", "--request", write(tmp_path, request), "--calibration",
                                            write(tmp_path, earlier, "earlier.json")]))
    assert as_printed["predicted"]["iteration_time_s"] == pytest.approx(plain["predicted"]["iteration_time_s"],
                                                                         abs=1.01e-6)
    assert "runs[0]" in run_error(capsys, ["estimate", "--request", write(tmp_path, request), "--calibration",
                                           write(tmp_path, bad, "bad.json")])


def test_the_table_says_which_calibration_priced_the_plan_and_where_it_extrapolates(tmp_path, capsys):
    layout = {"tp": 1, "pp": 2, "micro_batch_size": 1, "recompute": "none", "schedule": "1f1b"}
    request = estimate_request(layout)
    plain = json.loads(run_ok(capsys, ["estimate", "--request", write(tmp_path, request)]))
    runs = {"name": "cli", "runs": [{**request, "measured_iteration_time_s": plain["predicted"]["iteration_time_s"]}]}
    path = write(tmp_path, runs, "runs.json")
    inside = run_ok(capsys, ["estimate", "--request", write(tmp_path, request), "--calibration", path,
                             "--format", "table"])
    assert "priced with calibration" in inside and "extrapolates" not in inside
    wider = estimate_request({**layout, "tp": 4})
    outside = run_ok(capsys, ["estimate", "--request", write(tmp_path, wider), "--calibration", path,
                              "--format", "table"])
    assert "extrapolates: tp 4: the calibration's runs span 1" in outside
    assert "priced with calibration" not in run_ok(capsys, ["estimate", "--request", write(tmp_path, request),
                                                            "--format", "table"])
