"""The README's error examples (`$ curl ... -d '...'` followed by the answer) answer exactly as printed."""

from __future__ import annotations

import json
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
# `$ curl -s -X POST http://127.0.0.1:8000/ROUTE ... -d 'BODY'` then the answer on the next line.
EXAMPLE = re.compile(r"\$ curl -s -X POST http://127\.0\.0\.1:8000(/\S+) [^\n]*\\\n\s+-d '(.*?)'\n(\{.*?\})\n```", re.DOTALL)


def _examples() -> list[tuple[str, str, dict]]:
    found = [(route, body, json.loads(answer)) for route, body, answer in EXAMPLE.findall(README.read_text())
             if "detail" in answer]
    assert len(found) >= 2, "the README's error examples were not found"
    return found


def test_every_readme_error_example_answers_as_printed(client):
    for route, body, printed in _examples():
        response = client.post(route, content=body, headers={"content-type": "application/json"})
        assert response.status_code == 422, response.text
        assert response.json() == printed, (route, body)
