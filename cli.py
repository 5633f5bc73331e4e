"""The `resiplan` command line: serve, plan, estimate, compare, calibrate, export, import, launch."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pydantic import ValidationError

from planner.errors import PlanningError
from wire.schemas import EstimateRequest, Plan, PlanRequest

EXIT_BAD_REQUEST = 2
LAUNCH_FORMATS = ("megatron", "deepspeed", "torchtitan")
TOKEN_ENV = "RESIPLAN_API_TOKEN"


def _read_text(path: str) -> str:
    try:
        return sys.stdin.read() if path == "-" else Path(path).read_text()
    except UnicodeDecodeError:
        raise PlanningError(f"{'stdin' if path == '-' else path} is not UTF-8 text; expected a JSON file") from None


def _json_file(path: str) -> object:
    """A JSON file's value; what cannot be read as JSON (bad syntax, a number of thousands of digits, nesting
    deeper than Python recurses) is a PlanningError naming the file."""
    try:
        return json.loads(_read_text(path))
    except json.JSONDecodeError as error:
        raise PlanningError(f"{path} is not JSON: {error}") from None
    except (ValueError, RecursionError) as error:
        raise PlanningError(f"{path} cannot be read as JSON: {error or 'it nests too deeply'}") from None


def _read_request(path: str, model: type[PlanRequest]) -> PlanRequest:
    return model.model_validate_json(_read_text(path))


def _print_plan(plan: Plan, output_format: str) -> None:
    if output_format == "json":
        print(plan.model_dump_json(indent=2))
        return
    from render.table import render_table

    render_table(plan)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from api.app import create_app
    from api.core.logs import uvicorn_log_config

    # JSON lines for uvicorn's own messages too; requests are logged by the app, with their ids.
    uvicorn.run(create_app(), host=args.host, port=args.port, log_level=args.log_level,
                log_config=uvicorn_log_config(args.log_level), access_log=False)
    return 0


def _calibration(args: argparse.Namespace):
    """The calibration `--calibration FILE` names, or None: FILE is what `resiplan calibrate` prints, or the runs
    it fits (its --runs file), fitted now under this version's cost model."""
    if args.calibration is None:
        return None
    from api.tasks.calibrating import calibration_for
    from cost_models.efficiency import CALIBRATION_BOUNDS, EFFICIENCY_BOUNDS
    from wire.calibration import AppliedCalibration, Calibration, CalibrationRequest

    text = _read_text(args.calibration)
    value = _json_file(args.calibration)
    if isinstance(value, dict) and "roles" in value and "calibration_id" not in value:
        raise PlanningError(f"{args.calibration} has roles: the command line fits runs only; roles name plans a "
                            "service stored, so fit them with POST /v1/calibrations and pass what it answers")
    is_runs = isinstance(value, dict) and "runs" in value and "calibration_id" not in value
    if is_runs:
        return AppliedCalibration.of(calibration_for(CalibrationRequest.model_validate_json(text)))
    calibration = Calibration.model_validate_json(text)
    # A printed calibration may have been edited by hand: its parameters must be ones a fit could give, or the
    # built-in values a fit keeps for what its runs cannot determine.
    for name, value in calibration.parameters.items():
        if name not in CALIBRATION_BOUNDS:
            continue  # not a parameter this version prices with: AppliedCalibration leaves it out
        low, high = (min(bound[name][0] for bound in (CALIBRATION_BOUNDS, EFFICIENCY_BOUNDS)),
                     max(bound[name][1] for bound in (CALIBRATION_BOUNDS, EFFICIENCY_BOUNDS)))
        if not low <= value <= high:
            raise PlanningError(f"{args.calibration}: parameters.{name} is {value!r}; a calibration's {name} lies in "
                                f"[{low:g}, {high:g}]")
    return AppliedCalibration.of(calibration)


def _plan(args: argparse.Namespace) -> int:
    from api.tasks.planning import plan_for

    _print_plan(plan_for(_read_request(args.request, PlanRequest), calibration=_calibration(args)), args.format)
    return 0


def _estimate(args: argparse.Namespace) -> int:
    from api.tasks.planning import estimate_for

    _print_plan(estimate_for(_read_request(args.request, EstimateRequest), _calibration(args)), args.format)
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from api.tasks.calibrating import calibration_for
    from wire.calibration import CalibrationRequest

    print(calibration_for(CalibrationRequest.model_validate_json(_read_text(args.request))).model_dump_json(indent=2))
    return 0


def _compare(args: argparse.Namespace) -> int:
    from api.tasks.comparing import compare_for

    comparison = compare_for(_read_request(args.request, EstimateRequest), _calibration(args))
    if args.format == "json":
        print(comparison.model_dump_json(indent=2))
        return 0
    from render.table import render_comparison

    render_comparison(comparison)
    return 0


def _export(args: argparse.Namespace) -> int:
    from adapters.registry import export_format

    from adapters.plan_shape import check_exportable

    exporter = export_format(args.format)
    plan = Plan.model_validate_json(_read_text(args.plan))
    check_exportable(plan)
    text = exporter.render(plan, args.replica)
    if args.output:
        try:
            Path(args.output).write_text(text)
        except OSError as error:
            raise PlanningError(f"cannot write {args.output}: {error.strerror or error}") from None
    else:
        sys.stdout.write(text)
    return 0


def _import(args: argparse.Namespace) -> int:
    if args.trainer == "megatron":
        from adapters.megatron_import import import_megatron

        imported = import_megatron(_read_text(args.command_line), vocab_size=args.vocab_size)
    elif args.trainer == "deepspeed":
        from adapters.deepspeed_import import import_deepspeed

        megatron_args = _read_text(args.megatron_args) if args.megatron_args else None
        imported = import_deepspeed(_json_file(args.command_line), megatron_args, vocab_size=args.vocab_size)
    else:
        from adapters.torchtitan_import import import_torchtitan

        model = args.model
        if model is not None and model.endswith(".json"):
            model = _json_file(model)
        toml = _read_text(args.toml) if args.toml else None
        imported = import_torchtitan(_read_text(args.command_line), toml=toml, model=model)
    request = imported.request
    if args.cluster:
        request = {**request, "cluster": _json_file(args.cluster)}
        EstimateRequest.model_validate(request)  # what `resiplan estimate` and /v1/estimate take, checked now
    print(json.dumps({"request": request, "not_modelled": imported.not_modelled, "ignored": imported.ignored,
                      "notes": imported.notes}, indent=2))
    return 0


def _launcher(format_name: str):
    """The format's module, with its `launch_command(plan) -> str`, checked before any planning is asked for."""
    import importlib

    from adapters.registry import ExportError, export_format

    try:
        exporter = export_format(format_name)
    except ExportError:
        raise ExportError(f"unknown trainer {format_name!r}; launch works with: {', '.join(LAUNCH_FORMATS)}") from None
    try:
        module = importlib.import_module(exporter.module)
    except ModuleNotFoundError as error:
        missing = "it is not installed" if error.name == exporter.module else f"it needs the package {error.name!r}"
        raise ExportError(f"format {format_name!r} is not available: {missing}") from error
    launch_command = getattr(module, "launch_command", None)
    if not callable(launch_command):
        raise ExportError(
            f"format {format_name!r} has no launch command; launch works with: {', '.join(LAUNCH_FORMATS)}"
        )
    return module


def _stock_request(request: PlanRequest) -> PlanRequest:
    """Ask for a plan stock trainers run unless the request says otherwise explicitly."""
    if "allow_non_uniform" in request.options.model_fields_set:
        return request
    options = request.options.model_copy(update={"allow_non_uniform": False})
    return request.model_copy(update={"options": options})


def _launch(args: argparse.Namespace) -> int:
    from adapters.client import PlannerClient, PlannerError
    from adapters.shell_text import inert, required_summary

    launcher = _launcher(args.format)
    request = _stock_request(_read_request(args.request, PlanRequest))
    token = args.token or os.environ.get(TOKEN_ENV) or None
    if token is not None and not (token.isascii() and token.isprintable()):
        raise PlanningError(f"the bearer token (--token or ${TOKEN_ENV}) must be printable ASCII: HTTP headers carry "
                            "nothing else")
    try:
        with PlannerClient(args.server, token, timeout_s=args.timeout, retries=args.retries) as client:
            plan = client.plan(request)
    except PlannerError as error:
        print(f"resiplan: {error}", file=sys.stderr)
        return EXIT_BAD_REQUEST
    plan_id = inert(plan.plan_id)  # the server's text, kept from the terminal's control sequences too
    print(f"resiplan: plan {plan_id} ({args.server.rstrip('/')}/v1/plans/{plan_id})", file=sys.stderr)
    command = launcher.launch_command(plan)
    sys.stdout.write(command if command.endswith("\n") else command + "\n")
    required = getattr(launcher, "REQUIRED", ())
    if required:
        print(f"resiplan: the {args.format} command needs what the plan cannot know: {required_summary(required)}",
              file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="resiplan", description="Failure-aware parallel layout planning.")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the HTTP service")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_port, default=8000)
    serve.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug", "trace"))
    serve.set_defaults(run=_serve)

    for name, handler, help_text in (
        ("plan", _plan, "plan a request file (PlanRequest JSON, '-' for stdin)"),
        ("estimate", _estimate, "estimate a fixed layout (PlanRequest JSON with 'layout')"),
        ("compare", _compare, "a fixed layout (PlanRequest JSON with 'layout') against the best plan, and what "
                              "each difference buys"),
    ):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("--request", required=True, metavar="REQUEST.json")
        command.add_argument("--format", choices=("json", "table"), default="json", help="json (default) or a table for people")
        command.add_argument("--calibration", metavar="CALIBRATION.json",
                             help="price with this calibration: what `resiplan calibrate` prints, or its RUNS.json "
                             "(fitted now, under this version's cost model: a printed calibration keeps the "
                             "parameters of the version that fitted it); the request's options.calibration_id, if "
                             "any, must be its id")
        command.set_defaults(run=handler)

    calibrate = commands.add_parser(
        "calibrate", help="fit the cost model to measured runs and print the calibration JSON",
        description="RUNS.json is POST /v1/calibrations' body: {\"name\", \"runs\": [estimate request + "
                    "measured_iteration_time_s, ...]}. The calibration is printed, not stored; pass it to plan, "
                    "estimate or compare with --calibration.")
    calibrate.add_argument("--runs", required=True, dest="request", metavar="RUNS.json")
    calibrate.set_defaults(run=_calibrate)

    from adapters.registry import FORMATS

    export = commands.add_parser(
        "export",
        help="turn a plan (the JSON `plan` prints) into a trainer's input or a picture",
        description="Formats: " + "; ".join(f"{f.name}: {f.description}" for f in FORMATS),
    )
    export.add_argument("--format", required=True, choices=[f.name for f in FORMATS])
    export.add_argument("--replica", type=int, default=None, help="replica id (default: the slowest replica)")
    export.add_argument("--output", "-o", default=None, metavar="FILE", help="write here instead of stdout")
    export.add_argument("plan", metavar="PLAN.json", help="a Plan JSON file, '-' for stdin")
    export.set_defaults(run=_export, request=None)

    imports = commands.add_parser(
        "import",
        help="read a trainer's settings back into a request (Megatron-LM flags, torchtitan overrides, DeepSpeed configs)",
        description="Prints {request, not_modelled, ignored, notes}: the estimate request the command line "
        "describes (add the cluster with --cluster, or by hand), the flags that change time or memory but are not "
        "modelled, and those ignored because they change neither. Shell quoting, line continuations and comments "
        "are read as a shell would.",
    )
    imports.add_argument("trainer", choices=("megatron", "torchtitan", "deepspeed"),
                         help="the trainer whose settings they are")
    imports.add_argument("command_line", metavar="SETTINGS",
                         help="a file holding the command line (torchtitan: its overrides; deepspeed: ds_config.json), "
                         "'-' for stdin")
    imports.add_argument("--megatron-args", default=None, metavar="COMMAND.sh",
                         help="deepspeed: the Megatron-DeepSpeed command line the config runs beside")
    imports.add_argument("--vocab-size", type=_non_negative_int, default=None,
                         help="megatron: the tokenizer's vocabulary when the command line has no --vocab-size")
    imports.add_argument("--toml", default=None, metavar="JOB.toml",
                         help="torchtitan: an older torchtitan's TOML job file, under the overrides")
    imports.add_argument("--model", default=None, metavar="PRESET|MODEL.json",
                         help="torchtitan: the model, where --module/--config name none resiplan reads")
    imports.add_argument("--cluster", default=None, metavar="CLUSTER.json",
                         help="a cluster object to complete the request with (checked as an estimate request)")
    imports.set_defaults(run=_import, request=None)

    launch = commands.add_parser(
        "launch",
        help="ask a running resiplan service for a plan and print the trainer's launch command",
        description="POSTs the request to the service and prints the `torchrun ...` line that runs the plan. "
        "Unless the request sets options.allow_non_uniform, it asks for a plan stock trainers run "
        "(allow_non_uniform: false). The plan id goes to stderr.",
    )
    launch.add_argument("--format", required=True, metavar="{" + ",".join(LAUNCH_FORMATS) + "}", help="the trainer")
    launch.add_argument("--request", required=True, metavar="REQUEST.json", help="PlanRequest JSON, '-' for stdin")
    launch.add_argument("--server", default="http://127.0.0.1:8000", help="service URL (default %(default)s)")
    launch.add_argument("--token", default=None, help=f"bearer token (default: ${TOKEN_ENV})")
    launch.add_argument("--retries", type=_non_negative_int, default=4, help="retries while the service is unreachable "
                        "or busy (default %(default)s)")
    launch.add_argument("--timeout", type=_positive_float, default=120.0, metavar="SECONDS",
                        help="wait at least this long for the plan; never less than the request's time limit + 30 s "
                        "(default %(default)s)")
    launch.set_defaults(run=_launch)
    return parser


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0-65535, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except OSError as error:
        print(f"resiplan: cannot read {error.filename or _input_name(args)}: {error.strerror or error}", file=sys.stderr)
    except UnicodeDecodeError:
        print(f"resiplan: {_input_name(args)} is not UTF-8 text; expected a JSON file", file=sys.stderr)
    except ValidationError as error:
        what = "plan" if args.command == "export" else "request"
        print(f"resiplan: invalid {what}:\n{_validation_text(error)}", file=sys.stderr)
    except json.JSONDecodeError as error:
        print(f"resiplan: request is not JSON: {error}", file=sys.stderr)
    except PlanningError as error:
        print(f"resiplan: {error}", file=sys.stderr)
    return EXIT_BAD_REQUEST


def _input_name(args: argparse.Namespace) -> str:
    return getattr(args, "plan", None) or getattr(args, "command_line", None) or args.request


def _validation_text(error: ValidationError) -> str:
    from wire.errors import field_errors

    errors = field_errors(error.errors(include_url=False, include_input=False))
    return "\n".join(f"  {item['field'] or '(file)'}: {item['message']}" for item in errors)


if __name__ == "__main__":
    sys.exit(main())
