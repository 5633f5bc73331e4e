"""The `resiplan` command line: serve, plan, estimate, export."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import ValidationError

from api.schemas import EstimateRequest, Plan, PlanRequest
from planner.errors import PlanningError

EXIT_BAD_REQUEST = 2


def _read_text(path: str) -> str:
    return sys.stdin.read() if path == "-" else Path(path).read_text()


def _read_request(path: str, model: type[PlanRequest]) -> PlanRequest:
    return model.model_validate_json(_read_text(path))


def _print_plan(plan: Plan, output_format: str) -> None:
    if output_format == "json":
        print(plan.model_dump_json(indent=2))
        return
    from api.summary import render_table

    render_table(plan)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from api.app import create_app

    uvicorn.run(create_app(), host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from api.service import plan_for

    _print_plan(plan_for(_read_request(args.request, PlanRequest)), args.format)
    return 0


def _estimate(args: argparse.Namespace) -> int:
    from api.service import estimate_for

    _print_plan(estimate_for(_read_request(args.request, EstimateRequest)), args.format)
    return 0


def _export(args: argparse.Namespace) -> int:
    from adapters.registry import export_format

    exporter = export_format(args.format)
    plan = Plan.model_validate_json(_read_text(args.plan))
    text = exporter.render(plan, args.replica)
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="resiplan", description="Failure-aware parallel layout planning.")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the HTTP service")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--log-level", default="info")
    serve.set_defaults(run=_serve)

    for name, handler, help_text in (
        ("plan", _plan, "plan a request file (PlanRequest JSON, '-' for stdin)"),
        ("estimate", _estimate, "estimate a fixed layout (PlanRequest JSON with 'layout')"),
    ):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("--request", required=True, metavar="REQUEST.json")
        command.add_argument("--format", choices=("json", "table"), default="json", help="json (default) or a table for people")
        command.set_defaults(run=handler)

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
    return parser


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
    return getattr(args, "plan", None) or args.request


def _validation_text(error: ValidationError) -> str:
    return "\n".join(
        f"  {'.'.join(str(part) for part in item['loc']) or '(body)'}: {item['msg']}" for item in error.errors()
    )


if __name__ == "__main__":
    sys.exit(main())
