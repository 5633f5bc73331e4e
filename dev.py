#!/usr/bin/env python3
"""The two set-up commands, needing only python3:

    python3 dev.py serve   # start the service on 127.0.0.1:8000 (creates .venv on first use)
    python3 dev.py test    # run the whole test suite (creates .venv on first use)

Extra arguments go to `resiplan serve` or to pytest. The virtual environment
is reinstalled when pyproject.toml changes.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PYTHON = BIN / "python"
PYTEST_NO_TESTS = 5


def _ensure_venv(extras: str) -> None:
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + extras.encode()).hexdigest()
    stamp = VENV / f".installed-{extras or 'base'}"
    if stamp.exists() and stamp.read_text() == digest and PYTHON.exists():
        return
    if not PYTHON.exists():
        print(f"dev.py: creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    target = f".[{extras}]" if extras else "."
    print(f"dev.py: installing {target} into {VENV}", flush=True)
    subprocess.run([str(PYTHON), "-m", "pip", "install", "--quiet", "--upgrade", "pip"], check=True, cwd=ROOT)
    subprocess.run([str(PYTHON), "-m", "pip", "install", "--quiet", "-e", target], check=True, cwd=ROOT)
    stamp.write_text(digest)


def serve(args: list[str]) -> int:
    _ensure_venv("postgres")
    return subprocess.call([str(BIN / "resiplan"), "serve", *args], cwd=ROOT)


def _chromium_installed() -> bool:
    """The plan page is tested in a real browser: Debian's Chromium."""
    return Path("/usr/bin/chromium").exists()


def _postgresql_installed() -> bool:
    """The store tests also run against a throwaway PostgreSQL server, started from Debian's binaries
    (tests/postgres_server.py; a server elsewhere on PATH is not what CI runs)."""
    return any(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))


# Debian packages the test suite needs, each with how to tell it is installed.
TEST_PACKAGES = {"chromium": _chromium_installed, "postgresql": _postgresql_installed}


def _ensure_test_packages() -> None:
    """Install the missing ones with apt, in one call."""
    missing = [name for name, installed in TEST_PACKAGES.items() if not installed()]
    if not missing:
        return
    apt_get = ["apt-get"] if os.geteuid() == 0 else ["sudo", "apt-get"]
    install = [*apt_get, "install", "-y", "--no-install-recommends", *missing]
    print(f"dev.py: installing Debian's {' and '.join(missing)} for the tests", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.call(install, env=env) != 0:
        # A fresh machine may not have the package lists yet.
        subprocess.run([*apt_get, "update"], check=True, env=env)
        subprocess.run(install, check=True, env=env)


def test(args: list[str]) -> int:
    _ensure_venv("test,frameworks")
    _ensure_test_packages()
    code = subprocess.call([str(PYTHON), "-m", "pytest", *args], cwd=ROOT)
    if code == PYTEST_NO_TESTS:
        print("dev.py: pytest collected no tests; that is a failure", file=sys.stderr)
        return 1
    return code


def main() -> int:
    commands = {"serve": serve, "test": test}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        print(__doc__, file=sys.stderr)
        return 2
    return commands[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
