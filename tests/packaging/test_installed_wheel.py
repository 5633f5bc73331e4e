"""The wheel a plain `pip install .` builds (what the Docker image runs) serves plans on its own.

Builds the wheel from this checkout, installs it non-editable into a new virtual environment, starts that
environment's `resiplan serve` from an empty directory (so nothing of the checkout can be imported) and
plans one request over HTTP. A module that reads a file the wheel does not ship (package data), a
dependency missing from pyproject.toml, or docs assets fetched from a CDN fail here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import httpx
import pytest

from tests.api.support import small_request, verify_plan
from tests.service_process import ROOT, served

INSTALL_TIMEOUT_S = 1200


def _run(command: list[str], cwd: Path) -> None:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    if done.returncode != 0:
        pytest.fail(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The bin/ directory of a fresh virtual environment holding only the wheel and its dependencies."""
    base = tmp_path_factory.mktemp("wheel")
    dist, environment = base / "dist", base / "venv"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(dist), str(ROOT)], base)
    (wheel,) = dist.glob("resiplan-*.whl")
    venv.EnvBuilder(with_pip=True, clear=True).create(environment)
    bin_dir = environment / ("Scripts" if os.name == "nt" else "bin")
    _run([str(bin_dir / "python"), "-m", "pip", "install", "--quiet", str(wheel)], base)
    return bin_dir


def test_the_installed_wheel_imports_nothing_from_the_checkout(installed, tmp_path):
    probe = "import api, planner, cost_models, adapters; print(api.__file__)"
    where = subprocess.run([str(installed / "python"), "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                           check=True).stdout.strip()
    assert "site-packages" in where and not where.startswith(str(ROOT)), where


def test_the_installed_wheel_serves_plans_and_offline_docs(installed, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with served(f"sqlite:///{tmp_path}/plans.db", tmp_path / "serve.log",
                command=(str(installed / "resiplan"),), cwd=run_dir) as (server,):
        body = small_request()
        response = httpx.post(f"{server.base_url}/v1/plan", json=body, timeout=120)
        assert response.status_code == 200, response.text
        verify_plan(response.json(), body)
        # Example requests are package data: the OpenAPI document embeds them.
        examples = httpx.get(f"{server.base_url}/openapi.json", timeout=30).json()["paths"]["/v1/plan"]["post"]
        assert "healthy-32xa100-llama2-7b" in examples["requestBody"]["content"]["application/json"]["examples"]
        docs = httpx.get(f"{server.base_url}/docs", timeout=30)
        assert docs.status_code == 200 and "cdn." not in docs.text and "https://" not in docs.text.split("<body>")[0]
        for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
            assert f"/{asset}" in docs.text
            served_asset = httpx.get(f"{server.base_url}/static-offline-docs/{asset}", timeout=30)
            assert served_asset.status_code == 200 and len(served_asset.content) > 10_000, asset
