"""Reading the JSON preset tables shipped in cost_models/presets/."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources


@cache
def preset_table(filename: str) -> dict[str, dict]:
    """name -> fields of presets/<filename>; keys starting with "_" are documentation."""
    text = resources.files(__package__).joinpath("presets", filename).read_text()
    return {name: spec for name, spec in json.loads(text).items() if not name.startswith("_")}
