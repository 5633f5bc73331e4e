"""The package layout's rules (README "How the code is laid out"), read from the imports themselves with `ast`.

- `cost_models` imports nothing of the project;
- `planner` imports only `cost_models` (never FastAPI, SQLAlchemy, pydantic, `wire`, `api`, `adapters`, ...);
- `detector` imports only `cost_models`;
- `wire` imports `planner` and `cost_models` (to build problems and read results), never `api` or FastAPI;
- `adapters`, `render` and `executor` never import `api` (`executor` reads `planner.replan.holdings`); `render` may read `adapters.registry` (the formats
  its page links to), `adapters` never imports `render` (the registry names the SVG renderer by module path);
- nothing imports `benchmarks` or `tests` but themselves;
- no cycle between top-level packages, and no production module over 600 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ("wire", "api", "planner", "detector", "cost_models", "adapters", "render", "executor", "benchmarks",
           "tests", "cli")
PRODUCTION = ("wire", "api", "planner", "detector", "cost_models", "adapters", "render", "executor", "cli")
# What each production package may import of the project (besides itself).
ALLOWED = {
    "cost_models": set(),
    "planner": {"cost_models"},
    "detector": {"cost_models"},
    "wire": {"planner", "cost_models"},
    "adapters": {"wire", "planner", "cost_models"},
    # The page links to every export format, and shows the replica the exports would: adapters.registry.
    "render": {"wire", "planner", "cost_models", "adapters"},
    # It holds state as planner.replan.holdings lays it out: what the service's transfers are planned from.
    "executor": {"wire", "adapters", "cost_models", "planner"},
    "api": {"wire", "planner", "detector", "cost_models", "adapters", "render"},
    "cli": {"api", "wire", "planner", "cost_models", "adapters", "render"},
}
# Third-party packages the pure layers must not touch: web framework, database, the wire models.
FORBIDDEN_THIRD_PARTY = {
    "cost_models": {"fastapi", "starlette", "sqlalchemy", "pydantic", "ortools", "torch"},
    "planner": {"fastapi", "starlette", "sqlalchemy", "pydantic", "torch", "uvicorn"},
    "detector": {"fastapi", "starlette", "sqlalchemy", "pydantic", "torch", "ortools"},
    "wire": {"fastapi", "starlette", "sqlalchemy", "uvicorn"},
    "render": {"fastapi", "starlette", "sqlalchemy"},
    "adapters": {"fastapi", "starlette", "sqlalchemy"},
}
MAX_MODULE_LINES = 600


def _modules(package: str) -> list[Path]:
    return [ROOT / "cli.py"] if package == "cli" else sorted((ROOT / package).rglob("*.py"))


def _imports(path: Path) -> set[str]:
    """Top-level names of every module `path` imports (at any depth: lazy imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def _graph() -> dict[str, set[str]]:
    return {package: {name for path in _modules(package) for name in _imports(path) if name in PROJECT} - {package}
            for package in PROJECT}


@pytest.mark.parametrize("package", PRODUCTION)
def test_each_package_imports_only_what_it_may(package):
    wrong = {}
    for path in _modules(package):
        bad = {name for name in _imports(path) if name in PROJECT and name != package and name not in ALLOWED[package]}
        bad |= _imports(path) & FORBIDDEN_THIRD_PARTY.get(package, set())
        if bad:
            wrong[str(path.relative_to(ROOT))] = sorted(bad)
    assert not wrong, f"{package} may import only {sorted(ALLOWED[package])} of the project: {wrong}"


def test_nothing_imports_benchmarks_or_tests():
    for package in PRODUCTION:
        for path in _modules(package):
            assert not _imports(path) & {"benchmarks", "tests"}, path


def test_no_cycle_between_top_level_packages():
    graph = _graph()
    production = {package: graph[package] & set(PRODUCTION) for package in PRODUCTION}
    state: dict[str, str] = {}

    def visit(package: str, path: list[str]) -> None:
        state[package] = "open"
        for other in sorted(production[package]):
            assert state.get(other) != "open", f"import cycle: {' -> '.join([*path, package, other])}"
            if other not in state:
                visit(other, [*path, package])
        state[package] = "done"

    for package in PRODUCTION:
        if package not in state:
            visit(package, [])


def test_no_production_module_is_over_600_lines():
    long = {str(path.relative_to(ROOT)): count for package in PRODUCTION for path in _modules(package)
            if (count := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long


def test_the_rules_catch_a_violation(tmp_path):
    """The checker itself: an import the rules forbid is found (so the tests above can fail)."""
    module = tmp_path / "bad.py"
    module.write_text("def f():\n    from api.core.store import PlanStore\n    import fastapi\n")
    assert {"api", "fastapi"} <= _imports(module)
