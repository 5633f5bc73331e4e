"""Quoting of plan-derived text for the contexts the renderers write it into: HTML, SVG (XML) and URLs.

A plan's strings are user text (`model`, `architecture.name`) or could be, in a plan file handed to
`resiplan export`: device ids, schedule names, op labels. Escaping `&`, `<`, `>` and quotes is not
enough for XML, which cannot carry NUL, most other C0 controls, lone surrogates (they cannot even
be encoded as UTF-8) or U+FFFE/U+FFFF at all: any of them makes an SVG not well-formed. They and
HTML's other "noncharacters" and C1 controls (parse errors there) become U+FFFD, so the reader sees
that something was there.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from html import escape as _html_escape
from urllib.parse import quote, urlencode

REPLACEMENT = "\ufffd"

# Everything outside XML 1.0's Char production, plus C1 controls and the Unicode noncharacters
# (U+FDD0-FDEF, and the last two code points of every plane).
_UNSAFE_CHARS = re.compile(
    "[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff\ufdd0-\ufdef\ufffe\uffff"
    + "".join(f"{chr(plane * 0x10000 + 0xFFFE)}{chr(plane * 0x10000 + 0xFFFF)}" for plane in range(1, 17))
    + "]"
)


def safe_chars(text: str) -> str:
    """`text` with every character XML or HTML cannot carry as text replaced by U+FFFD."""
    return _UNSAFE_CHARS.sub(REPLACEMENT, text)


def html_text(text: object) -> str:
    """For HTML element content and double- or single-quoted attribute values."""
    return _html_escape(safe_chars(str(text)), quote=True)


def xml_text(text: object) -> str:
    """For SVG/XML text content and quoted attribute values (also right inline in HTML: same escapes)."""
    return html_text(text)


def url_path_segment(text: object) -> str:
    """One path segment: every byte but unreserved ones percent-encoded, `/` included."""
    return quote(safe_chars(str(text)), safe="")


def service_href(path: str, query: Mapping[str, object] | None = None, link_query: Mapping[str, str] | None = None,
                 fragment: str = "") -> str:
    """An href back at the service, attribute-escaped: `path` (already quoted), then `query`, then the
    caller's `link_query` (e.g. a view link's signature) so the page's links keep working behind auth."""
    items = [(key, str(value)) for key, value in (query or {}).items()]
    items += [(safe_chars(str(key)), safe_chars(str(value))) for key, value in (link_query or {}).items()]
    url = path + (f"?{urlencode(items)}" if items else "") + (f"#{quote(fragment)}" if fragment else "")
    return html_text(url)
