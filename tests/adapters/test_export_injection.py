"""Hostile plan text never acts in a shell: every export and launch command, sourced and run for real.

A plan is data a client sent, or crafted (`resiplan export PLAN.json` reads any file): its plan_id and
the model's name can hold newlines, quotes, `$(...)`, backticks, `</script>`, NUL, Unicode line
separators and lone surrogates (which a Plan parsed by json.loads keeps). For each such plan the test,
in a throwaway directory:

- writes every rendered text to a file as UTF-8 (a lone surrogate must not make that fail);
- `source`s the Megatron fragment in bash and reads MEGATRON_ARGS back: it is `megatron_args(plan)`;
- runs each launch command through `bash -n`, then runs it with `torchrun` / `deepspeed` replaced by a
  stub on PATH that records its arguments: Megatron's are exactly torchrun's flags, pretrain_gpt.py,
  `megatron_args(plan)` and the required settings' values;
- and checks that no marker file the hostile text tries to create appears.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters import deepspeed, json_plan, megatron, torchtitan
from adapters.registry import ExportError
from adapters.stock import node_blocks
from api.tasks.planning import plan_for
from cli import main as cli_main
from tests.api.support import small_request
from wire.schemas import Plan, PlanRequest

MARKER = "PWNED"
# Each tries to run `touch PWNED` from a comment, a quoted word, a ${VAR:?message} or a here-document.
HOSTILE_FRAGMENTS = (
    f"\ntouch {MARKER}\n", f"\r\ntouch {MARKER}\r\n", f"$(touch {MARKER})", f"`touch {MARKER}`",
    f"'; touch {MARKER}; '", f'"; touch {MARKER}; "', f"}}; touch {MARKER}; {{", f"\u2028touch {MARKER}",
    f"\u0085touch {MARKER}", f"\x00\ntouch {MARKER}", f"x)\ntouch {MARKER}\n#", "</script><script>", "\\",
    "\ud800", "\udfff", "RESIPLAN_CSV\n", "RESIPLAN_HOSTS\n", "${IFS}", "*", "~root", "!!",
)
hostile_text = st.lists(st.one_of(st.sampled_from(HOSTILE_FRAGMENTS), st.text(max_size=6)), min_size=1,
                        max_size=6).map("".join)
HOSTILE = settings(max_examples=25, deadline=None, derandomize=True,
                   suppress_health_check=[HealthCheck.too_slow])

REQUIRED_VALUES = {"DATA_PATH": "/data/my corpus_text_document", "TOKENIZER_TYPE": "HuggingFaceTokenizer",
                   "TOKENIZER_MODEL": "meta-llama/Llama-2-7b-hf", "TRAIN_ITERS": "1000", "LR": "0.0003",
                   "HF_ASSETS_PATH": "/data/tokenizer", "DATASET": "c4_test", "TRAIN_STEPS": "10",
                   "TRAIN_SCRIPT": "train.py", "MASTER_ADDR": "10.0.0.1"}
STUB = """#!/bin/sh
{ printf '%s\\0' "$(basename "$0")" "$@"; printf '%s\\0' --END--; } >> "$CALLS"
"""


@functools.cache
def base_plan(name: str) -> Plan:
    failures = {"failed": ["1:3"]} if name == "failed-gpu" else {}
    request = small_request(options={"time_limit_s": 2, "allow_non_uniform": False}, failures=failures)
    return plan_for(PlanRequest.model_validate(request))


def hostile(plan: Plan, plan_id: str, name: str) -> Plan:
    return plan.model_copy(update={"plan_id": plan_id,
                                   "architecture": plan.architecture.model_copy(update={"name": name})})


def run_bash(script: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    stubs = cwd / "bin"
    stubs.mkdir(exist_ok=True)
    for program in ("torchrun", "deepspeed"):
        (stubs / program).write_text(STUB)
        (stubs / program).chmod(0o755)
    full_env = {"PATH": f"{stubs}:/usr/bin:/bin", "CALLS": str(cwd / "calls"), **REQUIRED_VALUES, **env}
    return subprocess.run(["bash", "-c", script], cwd=cwd, env=full_env, capture_output=True)


def calls(cwd: Path) -> list[list[str]]:
    """Each stubbed program run: [program, its arguments...]."""
    path = cwd / "calls"
    if not path.exists():
        return []
    words = path.read_bytes().decode().split("\0")[:-1]
    runs, current = [], []
    for word in words:
        if word == "--END--":
            runs.append(current)
            current = []
        else:
            current.append(word)
    return runs


def written(text: str, directory: Path, name: str) -> Path:
    """The text in a file, as UTF-8: raises if it holds anything UTF-8 cannot encode."""
    path = directory / name
    path.write_bytes(text.encode("utf-8"))
    return path


def expected_megatron_launch(plan: Plan, node_rank: int) -> list[str]:
    blocks = node_blocks(megatron.rank_devices(plan))
    nproc = len(blocks[node_rank][1])
    required = [word for setting in megatron.REQUIRED for word in (setting.flag, REQUIRED_VALUES[setting.variable])]
    return ["torchrun", "--nnodes", str(len(blocks)), "--nproc-per-node", str(nproc), "--node-rank", str(node_rank),
            "--master-addr", REQUIRED_VALUES["MASTER_ADDR"], "--master-port", str(megatron.MASTER_PORT),
            megatron.ENTRY_SCRIPT, *megatron.megatron_args(plan), *required]


def check_megatron(plan: Plan, cwd: Path) -> None:
    fragment = written(megatron.render(plan), cwd, "megatron.sh")
    sourced = run_bash(f'set -e; source {fragment.name}; printf "%s\\0" "${{MEGATRON_ARGS[@]}}"', cwd)
    assert sourced.returncode == 0, sourced.stderr
    assert sourced.stdout.decode().split("\0")[:-1] == megatron.megatron_args(plan)
    launch = written(megatron.launch_command(plan), cwd, "megatron-launch.sh")
    assert run_bash(f"bash -n {launch.name}", cwd).returncode == 0
    nodes = len(node_blocks(megatron.rank_devices(plan)))
    for node_rank in range(nodes):
        (cwd / "calls").unlink(missing_ok=True)
        ran = run_bash(f"set -e; source {launch.name}", cwd, NODE_RANK=str(node_rank))
        assert ran.returncode == 0, ran.stderr
        assert calls(cwd) == [expected_megatron_launch(plan, node_rank)]


def check_deepspeed(plan: Plan, cwd: Path) -> None:
    text = written(deepspeed.render(plan), cwd, deepspeed.CONFIG_FILE).read_text()
    document = json.loads(text)
    assert document[deepspeed.RESIPLAN_KEY]["plan_id"] == plan.plan_id  # JSON carries it, escaped
    assert document[deepspeed.RESIPLAN_KEY]["model"]["name"] == plan.architecture.name
    launch = written(deepspeed.launch_command(plan), cwd, "deepspeed-launch.sh")
    assert run_bash(f"bash -n {launch.name}", cwd).returncode == 0
    (cwd / "calls").unlink(missing_ok=True)
    ran = run_bash(f"set -e; NODE_RANK=0; source {launch.name}", cwd)
    assert ran.returncode == 0, ran.stderr
    assert calls(cwd) and all(run[-3:] == ["--deepspeed", "--deepspeed_config", deepspeed.CONFIG_FILE]
                              for run in calls(cwd))


def check_torchtitan(plan: Plan, cwd: Path) -> None:
    overrides = written(torchtitan.render(plan), cwd, "plan.args").read_text()
    assert overrides.split("\n")[:-1] == torchtitan.torchtitan_overrides(plan)
    launch = written(torchtitan.launch_command(plan), cwd, "torchtitan-launch.sh")
    assert run_bash(f"bash -n {launch.name}", cwd).returncode == 0
    (cwd / "calls").unlink(missing_ok=True)
    ran = run_bash(f"set -e; source {launch.name}", cwd, NODE_RANK="0", TORCHTITAN_MODULE="mine",
                   TORCHTITAN_CONFIG="my_config")
    assert ran.returncode == 0, ran.stderr
    (run,) = calls(cwd)
    words = run[run.index("-m") + 2:]
    assert words[:4] == ["--module", "mine", "--config", "my_config"]
    assert words[-1] == torchtitan.override_argv(plan)[-1]  # the activation-checkpoint subcommand stays last


@HOSTILE
@given(plan_id=hostile_text, name=hostile_text)
def test_no_export_or_launch_command_acts_on_plan_text(plan_id, name):
    for base in ("healthy", "failed-gpu"):
        plan = hostile(base_plan(base), plan_id, name)
        with tempfile.TemporaryDirectory() as directory:
            cwd = Path(directory)
            check_megatron(plan, cwd)
            check_deepspeed(plan, cwd)
            if base == "healthy":
                check_torchtitan(plan, cwd)
            written(json_plan.render(plan), cwd, "plan.json")
            assert not (cwd / MARKER).exists() and not list(cwd.glob(f"*{MARKER}*"))


@HOSTILE
@given(device=hostile_text)
def test_device_ids_that_are_not_node_gpu_are_refused(device):
    plan = base_plan("failed-gpu")
    for update in ({"unused_devices": [*plan.unused_devices, device]},
                   {"excluded_devices": [*plan.excluded_devices, device]}):
        tampered = plan.model_copy(update=update)
        for export in (megatron.launch_command, megatron.render, deepspeed.launch_command):
            try:
                text = export(tampered)
            except ExportError as refused:
                assert "is not" in str(refused) and "\n" not in str(refused)
            else:  # only a real device id is accepted: ASCII digits, a colon, digits (or * when excluded)
                assert re.fullmatch(r"[0-9]+:([0-9]+|\*)", device), device
                assert MARKER not in text


def test_lone_surrogates_in_a_parsed_plan_still_export_as_utf8():
    plan = hostile(base_plan("healthy"), "id-\ud800", "model-\udfff")
    text = json_plan.render(plan)
    text.encode("utf-8")
    back = Plan.model_validate_json(text)
    assert back.plan_id == "id-\ufffd" and back.architecture.name == "model-\ufffd"
    assert back.replicas == plan.replicas


def test_cli_export_of_a_crafted_plan_file_sources_harmlessly(tmp_path):
    crafted = json.loads(base_plan("healthy").model_dump_json())
    crafted["plan_id"] = f"x)\ntouch {MARKER}\n#"
    crafted["architecture"]["name"] = f"$(touch {MARKER})`touch {MARKER}`"
    (tmp_path / "plan.json").write_text(json.dumps(crafted))
    exported = ["export", "--format", "megatron", "-o", str(tmp_path / "args.sh"), str(tmp_path / "plan.json")]
    assert cli_main(exported) == 0
    sourced = run_bash('source args.sh; printf "%s\\0" "${MEGATRON_ARGS[@]}"', tmp_path)
    assert sourced.returncode == 0
    assert sourced.stdout.decode().split("\0")[:-1] == megatron.megatron_args(Plan.model_validate(crafted))
    assert not (tmp_path / MARKER).exists()


def test_launch_commands_stop_naming_each_unset_setting(tmp_path):
    plan = base_plan("healthy")
    for module, settings_ in ((megatron, megatron.REQUIRED), (torchtitan, torchtitan.REQUIRED)):
        written(module.launch_command(plan), tmp_path, "launch.sh")
        for setting in settings_:
            (tmp_path / "calls").unlink(missing_ok=True)
            env = {k: v for k, v in REQUIRED_VALUES.items() if k != setting.variable}
            script = f"unset {setting.variable}; set -e; source launch.sh"
            env |= {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "CALLS": str(tmp_path / "calls"), "NODE_RANK": "0",
                    "TORCHTITAN_MODULE": "m", "TORCHTITAN_CONFIG": "c"}
            ran = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, env=env)
            assert ran.returncode != 0
            assert f"{setting.variable}: set {setting.variable} to" in ran.stderr
            assert calls(tmp_path) == []  # nothing started
        assert all(f"#   {setting.variable}: " in module.launch_command(plan) for setting in settings_)


def test_stub_sees_what_bash_would_run(tmp_path):
    """The harness itself: a stub on PATH records a quoted argument with spaces as one word."""
    ran = run_bash('torchrun "a b" c', tmp_path)
    assert ran.returncode == 0 and calls(tmp_path) == [["torchrun", "a b", "c"]]
    assert os.access(tmp_path / "bin" / "torchrun", os.X_OK)


def fixed_planner(answer: Plan) -> type:
    """A PlannerClient stand-in whose service answers every request with `answer`."""

    class Planner:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def plan(self, request):
            return answer

    return Planner


def test_resiplan_launch_says_on_stderr_what_is_still_to_set(tmp_path, capsys, monkeypatch):
    import adapters.client

    answer = hostile(base_plan("healthy"), "\x1b[2J\nid", "m")
    monkeypatch.setattr(adapters.client, "PlannerClient", fixed_planner(answer))
    (tmp_path / "request.json").write_text(json.dumps(small_request()))
    for trainer, module in (("megatron", megatron), ("torchtitan", torchtitan), ("deepspeed", deepspeed)):
        assert cli_main(["launch", "--format", trainer, "--request", str(tmp_path / "request.json")]) == 0
        out, err = capsys.readouterr()
        assert out == module.launch_command(answer)
        names = ", ".join(setting.variable for setting in module.REQUIRED)
        assert f"resiplan: the {trainer} command needs what the plan cannot know: set {names} before running it" in err
        assert "\x1b" not in err and "plan __2J_id" in err  # the server's text cannot drive the terminal
