"""Imported by solver workers in tests/api/test_execution.py: takes a while, then leaves a file named by the
importing process's id in $RESIPLAN_TEST_MARKER_DIR."""

from __future__ import annotations

import os
import pathlib
import time

time.sleep(float(os.environ.get("RESIPLAN_TEST_IMPORT_DELAY_S", "0")))
if directory := os.environ.get("RESIPLAN_TEST_MARKER_DIR"):
    pathlib.Path(directory, str(os.getpid())).write_text("imported")
