"""Parsing helpers for the UI tests."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

SVG = "{http://www.w3.org/2000/svg}"


def parse_svg(text: str) -> ET.Element:
    root = ET.fromstring(text)
    assert root.tag == f"{SVG}svg", root.tag
    return root


def classes(element: ET.Element) -> set[str]:
    return set(element.get("class", "").split())


def find_class(root: ET.Element, tag: str, name: str) -> list[ET.Element]:
    """Every `tag` element (e.g. "rect", "g") under root whose class list contains `name`."""
    return [e for e in root.iter(f"{SVG}{tag}") if name in classes(e)]


def text_of(element: ET.Element) -> str:
    return "".join(element.itertext())


def inline_svgs(html: str) -> list[str]:
    """The <svg>…</svg> documents inlined in an HTML page (none nest)."""
    return re.findall(r"<svg\b.*?</svg>", html, flags=re.DOTALL)
