"""Hostile text in a plan reaches the page and the SVGs only as text: no element, attribute or script of its own.

A plan's `model` is whatever the user called it; a plan file handed to `resiplan export` can hold
anything in its ids, schedule names and op labels. Every rendering must stay well-formed (XML for the
SVGs, balanced HTML for the page), encodable as UTF-8, and show the text, with the characters XML
cannot carry replaced by U+FFFD.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from urllib.parse import parse_qs, quote, urlsplit

from hypothesis import given
from hypothesis import strategies as st

from render.gantt_svg import render as gantt_render
from render.gantt_zoom_script import GANTT_ZOOM_JS
from render.markup import REPLACEMENT, safe_chars, xml_text
from render.plan_page import plan_page_html
from tests.ui.html_support import parse_html
from tests.ui.plans import small_plan
from tests.ui.svg_support import SVG, find_class, inline_svgs, parse_svg, text_of
from wire.schemas import Plan

FRAGMENTS = [
    "</script><script>alert(1)</script>", "<svg onload=alert(1)>", '"', "'", "$(touch /tmp/pwned)", "`id`",
    "\x00", "\ud800", "\udfff", "\ufffe", "\uffff", "\U0010ffff", "]]>", "<!--", "-->", "&amp;", "&#x3c;",
    "\u2028", "\u2029", "\n", "\r\n", "\t", "javascript:alert(1)", "\u202e", "<![CDATA[x", "</svg>", "</title>",
    "\x1b[31m", "\x7f", "\x85", "<style>*{display:none}</style>", "%3Cscript%3E", "{{7*7}}", "\\", "/../",
]
# Any code point at all, surrogates and controls included, mixed with the fragments above.
hostile_text = st.lists(
    st.one_of(st.sampled_from(FRAGMENTS), st.text(st.characters(exclude_categories=()), max_size=6)),
    min_size=1, max_size=5,
).map("".join).filter(bool)  # an empty model name is shown as "Plan"/"?": a different test

SVG_TAGS = {"svg", "style", "defs", "clipPath", "pattern", "rect", "text", "tspan", "title", "desc", "g", "line", "path"}

PAGE_TAGS = {
    "html", "head", "meta", "link", "title", "style", "body", "header", "h1", "h2", "bdi", "div", "dl", "dt", "dd",
    "p", "nav", "a", "strong", "span", "table", "thead", "tbody", "tr", "th", "td", "br", "ul", "li", "button",
    "code", "script", *(tag.lower() for tag in SVG_TAGS),
}


def xml_reads_text(text: str) -> str:
    """What an XML parser reports for escaped `text` as element content: line ends normalised to \\n."""
    return safe_chars(text).replace("\r\n", "\n").replace("\r", "\n")


def xml_reads_attribute(text: str) -> str:
    """... and as an attribute value: every tab and line end then becomes a space."""
    return re.sub("[\t\n]", " ", xml_reads_text(text))


def hostile_plan(text: str) -> Plan:
    """small_plan with `text` as model, plan id, schedule names, one op label and one device id."""
    body = small_plan().model_dump()
    body.update(model=text, plan_id=text, schedule=text, recompute=text, status=text)
    schedule = body["pipeline_schedule"]
    schedule["name"] = text
    schedule["replicas"][0]["schedule"] = text
    schedule["replicas"][0]["stages"][0]["ops"][0] = text
    body["replicas"][0]["stages"][0]["devices"][0] = text
    return Plan.model_validate(body)


def _check_svg(svg_text: str) -> ET.Element:
    svg_text.encode("utf-8")  # raises on a lone surrogate
    root = parse_svg(svg_text)
    for element in root.iter():
        assert element.tag.removeprefix(SVG) in SVG_TAGS, element.tag
        assert not any(name.lower().startswith("on") or name.endswith("href") for name in element.attrib), element.attrib
    return root


@given(hostile_text)
def test_gantt_svg_shows_hostile_text_as_text(text):
    shown = xml_reads_text(text)
    assert "\x00" not in shown and not any("\ud800" <= ch <= "\udfff" for ch in shown)
    root = _check_svg(gantt_render(hostile_plan(text), 0))
    subtitle = text_of(find_class(root, "text", "subtitle")[0])
    assert subtitle == f"model {shown} · 4 stages · 8 microbatches · 16 ops per stage · plan {shown}"
    title = text_of(find_class(root, "text", "title")[0])
    assert title.startswith(f"{shown} schedule · replica 0 ·")
    first_row = find_class(root, "g", "row")[0]
    first_op = find_class(first_row, "g", "ops")[0].findall(f"{SVG}rect")[0]
    assert first_op.get("data-op") == xml_reads_attribute(text)
    assert first_op.get("class").split()[0] in {"F", "B", "I", "W", "X"}
    row_title = text_of(find_class(first_row, "text", "lbl")[0].find(f"{SVG}title"))
    assert f"devices {shown}, 0:1 · " in row_title  # the hostile device id, as text


@given(hostile_text, hostile_text)
def test_plan_page_shows_hostile_text_as_text(text, signature):
    shown = safe_chars(text)
    html = plan_page_html(hostile_plan(text), None, None, link_query={"signature": signature})
    html.encode("utf-8")
    root = parse_html(html)  # balanced: every element closes where it opened
    for node in root.iter():
        if node.tag == "#document":
            continue
        assert node.tag in PAGE_TAGS, node.tag
        assert not any(name.startswith("on") for name in node.attrs), node.attrs
    scripts = root.find_all("script")
    assert [script.text() for script in scripts] == [GANTT_ZOOM_JS]
    assert root.find("h1").text() == shown
    assert root.find("title").text() == f"resiplan · {shown} · {shown}"
    for node in root.iter():
        href = node.attrs.get("href")
        if href is None or href == "data:,":
            continue
        parts = urlsplit(href)
        assert parts.scheme == "" and parts.netloc == "", href
        assert parts.path == "" or parts.path.startswith(f"/v1/plans/{quote(shown, safe='')}"), href
        assert parse_qs(parts.query, keep_blank_values=True)["signature"] == [safe_chars(signature)], href
    svgs = inline_svgs(html)
    for svg in svgs:
        _check_svg(svg)
    if re.fullmatch(r"[0-9]{1,6}:[0-9]{1,2}", shown) is None:
        # The hostile device id cannot be placed on a map: the page says so, in text, and keeps the chart.
        assert "cluster map cannot be drawn" in root.find("p", "note").text()
        assert [parse_svg(svg).get("class") for svg in svgs] == ["gantt"]


@given(st.text(st.characters(exclude_categories=()), max_size=40))
def test_xml_text_is_always_parseable_element_content_and_attribute(text):
    escaped = xml_text(text)
    escaped.encode("utf-8")
    element = ET.fromstring(f'<t a="{escaped}" b=\'{escaped}\'>{escaped}</t>')
    assert (element.text or "") == xml_reads_text(text)
    assert element.get("a") == element.get("b") == xml_reads_attribute(text)
    assert list(element) == []


def test_safe_chars_keeps_text_and_replaces_what_xml_cannot_carry():
    assert safe_chars("llama\t3\n8b é 漢 🦙") == "llama\t3\n8b é 漢 🦙"
    for bad in ("\x00", "\x08", "\x0b", "\x1f", "\x7f", "\x85", "\ud800", "\udfff", "\ufdd0", "\ufffe", "\uffff",
                "\U0001fffe", "\U0010ffff"):
        assert safe_chars(f"a{bad}b") == f"a{REPLACEMENT}b", repr(bad)
