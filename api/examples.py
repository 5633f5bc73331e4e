"""OpenAPI examples: the sample requests of ../shared/scenarios, shipped as package data."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any


@cache
def scenario_examples() -> dict[str, dict[str, Any]]:
    folder = resources.files(__package__).joinpath("examples")
    examples = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            name = entry.name.removesuffix(".json")
            examples[name] = {"summary": name, "value": json.loads(entry.read_text())}
    return examples


def estimate_examples() -> dict[str, dict[str, Any]]:
    base = scenario_examples()["healthy-32xa100-llama2-7b"]["value"]
    layout = {"tp": 2, "pp": 2, "micro_batch_size": 1, "virtual_stages": 1, "schedule": "1f1b", "recompute": "selective"}
    return {"llama2-7b-tp2-pp2": {"summary": "32 x A100, llama2-7b, tp=2 pp=2", "value": {**base, "layout": layout}}}
