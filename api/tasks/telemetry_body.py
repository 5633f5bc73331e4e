"""A /v1/detect body parsed one telemetry item at a time into compact per-item totals.

A large job's telemetry is tens of MB of JSON: 4,096 devices x 8 iterations of 8 packed microbatches is
~60 MB. Validated whole as pydantic objects it took a worker to ~1.2 GB, most of which the allocator kept
afterwards. Here the top-level object and the telemetry array are walked by hand with the json module's
C scanner; each item is parsed alone, validated by the wire model (`DeviceTelemetry`, so its constraints
and messages are the schema's), reduced to a `TelemetryTotals` (~200 bytes: the detector's work model is
linear in summed lengths and squared lengths) and dropped. What stays is the body, its text and the totals.

Everything a client sends is hostile data: errors name the item and field
(`telemetry[12].microbatches[3].compute_ms`), never echo a value, and cover what pydantic's own JSON
parser would refuse: NaN and Infinity (not JSON; they reach the models as non-finite floats, which the
models refuse), lone surrogates in strings (refused by the models; keys are never echoed raw), nesting
deeper than the interpreter's recursion limit, integers of more than 4,300 digits, bytes that are not UTF-8.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import TypeAdapter, ValidationError

from detector.telemetry import TelemetryTotals, squared_lengths
from wire.errors import RequestBodyInvalid, field_errors, validation_detail
from wire.detection import DetectRequest, DeviceTelemetry, MAX_TELEMETRY_ITEMS

# Validation stops after this many problems: a body of 100,000 bad items answers with a few, at once.
MAX_REPORTED_ERRORS = 20
_SPACE = re.compile(r"[ \t\n\r]*")
# Keys are echoed only when they look like field names; anything else is shown quoted, ASCII-escaped
# and cut short (a lone surrogate cannot be encoded in the answer; a 10 MB key must not come back).
_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_SHOWN_KEY_CHARS = 32
_PLAN_ID = TypeAdapter(Annotated[str, DetectRequest.model_fields["plan_id"]])
_TOP_LEVEL_KEYS = frozenset(DetectRequest.model_fields)


class BodyValidationError(RequestBodyInvalid):
    """A /v1/detect body that is not a valid DetectRequest: `detail` is one sentence, `errors` the failing
    fields as `{"field", "message"}`. Raised in a solver worker; pickles with both."""


@dataclass(frozen=True)
class DetectBody:
    plan_id: str
    telemetry: tuple[TelemetryTotals, ...]


def parse_detect_body(body: bytes) -> DetectBody:
    """`body` (a DetectRequest's JSON) as its plan id and per-item totals, or BodyValidationError."""
    if not body.strip():
        raise BodyValidationError("the request has no body; send a JSON DetectRequest object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BodyValidationError(
            f"the request body is not UTF-8 text (byte {error.start:,} is not valid UTF-8); JSON must be sent as UTF-8"
        ) from None
    return _Walker(text).request()


class _Stop(Exception):
    """Validation cannot or need not go on (a syntax error, or enough problems to report)."""


class _Walker:
    """One pass over the text of one body: positions, the problems found so far, the totals built."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.scan = json.JSONDecoder().scan_once  # the C scanner: one JSON value at an index
        self.problems: list[dict[str, Any]] = []  # pydantic-style items: loc, msg
        self.items_seen = 0  # of the telemetry array

    def request(self) -> DetectBody:
        try:
            plan_id, telemetry = self._top_level()
        except _Stop:
            plan_id, telemetry = None, None
        if self.problems:
            errors = field_errors(self.problems[:MAX_REPORTED_ERRORS])
            raise BodyValidationError(validation_detail(errors), errors)
        return DetectBody(plan_id=plan_id, telemetry=tuple(telemetry))

    # -- the grammar above the items -------------------------------------------------------------------

    def _top_level(self) -> tuple[str | None, list[TelemetryTotals] | None]:
        text = self.text
        index = self._skip(0)
        if not text.startswith("{", index):
            self._value(index, ())  # a syntax error if it is not JSON at all
            self._problem((), "Input should be a JSON object {plan_id, telemetry}")
            raise _Stop
        index = self._skip(index + 1)
        given: dict[str, Any] = {}
        telemetry: list[TelemetryTotals] | None = None
        if text.startswith("}", index):
            index += 1
        else:
            while True:
                if not text.startswith('"', index):
                    self._syntax((), "Expecting property name enclosed in double quotes", index)
                key, index = self._value(index, ())
                index = self._skip(index)
                if not text.startswith(":", index):
                    self._syntax((), "Expecting ':' delimiter", index)
                index = self._skip(index + 1)
                loc = (_shown_key(key),)
                if key in given:
                    self._problem(loc, "appears twice in the body; send each field once")
                if key == "telemetry":
                    telemetry, index = self._telemetry(index)
                    given[key] = telemetry
                else:
                    given[key], index = self._value(index, loc)
                    if key not in _TOP_LEVEL_KEYS:
                        self._problem(loc, "Extra inputs are not permitted")
                index = self._skip(index)
                if text.startswith(",", index):
                    index = self._skip(index + 1)
                    continue
                if text.startswith("}", index):
                    index += 1
                    break
                self._syntax((), "Expecting ',' delimiter", index)
        if self._skip(index) != len(text):
            self._syntax((), "Extra data after the JSON object", self._skip(index))
        return self._plan_id(given), self._required_telemetry(given, telemetry)

    def _plan_id(self, given: Mapping[str, Any]) -> str | None:
        if "plan_id" not in given:
            self._problem(("plan_id",), "Field required")
            return None
        try:
            return _PLAN_ID.validate_python(given["plan_id"])
        except ValidationError as error:
            self._problems_of(error, ("plan_id",))
            return None

    def _required_telemetry(
        self, given: Mapping[str, Any], telemetry: list[TelemetryTotals] | None
    ) -> list[TelemetryTotals] | None:
        if "telemetry" not in given:
            self._problem(("telemetry",), "Field required")
        elif telemetry is not None and self.items_seen == 0:
            self._problem(("telemetry",), "List should have at least 1 item after validation, not 0")
        return telemetry

    def _telemetry(self, index: int) -> tuple[list[TelemetryTotals] | None, int]:
        text = self.text
        if not text.startswith("[", index):
            _, index = self._value(index, ("telemetry",))
            self._problem(("telemetry",), "Input should be a valid list")
            return None, index
        index = self._skip(index + 1)
        totals: list[TelemetryTotals] = []
        self.items_seen = 0
        if text.startswith("]", index):
            return totals, index + 1
        devices: dict[str, str] = {}  # one string per device, not one per item
        while True:
            if self.items_seen == MAX_TELEMETRY_ITEMS:
                self._problem(("telemetry",), f"List should have at most {MAX_TELEMETRY_ITEMS} items")
                raise _Stop
            loc = ("telemetry", self.items_seen)
            value, index = self._value(index, loc)
            summary = self._item(value, loc, devices)
            if summary is not None:
                totals.append(summary)
            self.items_seen += 1
            index = self._skip(index)
            if text.startswith(",", index):
                index = self._skip(index + 1)
                continue
            if text.startswith("]", index):
                return totals, index + 1
            self._syntax(("telemetry",), "Expecting ',' delimiter", index)

    # -- one item --------------------------------------------------------------------------------------

    def _item(self, value: Any, loc: tuple[str | int, ...], devices: dict[str, str]) -> TelemetryTotals | None:
        try:
            item = DeviceTelemetry.model_validate(value)
        except ValidationError as error:
            self._problems_of(error, loc)
            return None
        if self.problems:
            return None  # the answer is a 422 anyway: no totals needed
        microbatches = item.microbatches
        return TelemetryTotals(
            device=devices.setdefault(item.device, item.device),
            iteration=item.iteration,
            microbatches=len(microbatches),
            # Summed in order, as TelemetryItem.compute_ms sums them: the same floats either way.
            compute_ms=sum(microbatch.compute_ms for microbatch in microbatches),
            tokens=sum(sum(microbatch.seq_lengths) for microbatch in microbatches),
            squared_lengths=sum(squared_lengths(microbatch.seq_lengths) for microbatch in microbatches),
            last_heartbeat_s_ago=item.last_heartbeat_s_ago,
        )

    # -- scanning and problems -------------------------------------------------------------------------

    def _skip(self, index: int) -> int:
        return _SPACE.match(self.text, index).end()

    def _value(self, index: int, loc: tuple[str | int, ...]) -> tuple[Any, int]:
        """The JSON value starting at `index` and the index after it."""
        try:
            return self.scan(self.text, index)
        except StopIteration as stop:
            self._syntax(loc, "Expecting value", stop.value)
        except json.JSONDecodeError as error:
            self._syntax(loc, error.msg, error.pos)
        except RecursionError:
            self._problem(loc, "Invalid JSON: arrays and objects nest too deeply")
        except ValueError:
            # The only other ValueError the scanner raises: int() refuses more than 4,300 digits.
            self._problem(loc, "Invalid JSON: an integer has more than 4,300 digits")
        raise _Stop

    def _syntax(self, loc: tuple[str | int, ...], message: str, position: int) -> None:
        line = self.text.count("\n", 0, position) + 1
        column = position - self.text.rfind("\n", 0, position)
        self._problem(loc, f"Invalid JSON: {message} (line {line}, column {column})")
        raise _Stop

    def _problem(self, loc: tuple[str | int, ...], message: str) -> None:
        self.problems.append({"loc": loc, "msg": message})
        if len(self.problems) >= MAX_REPORTED_ERRORS:
            raise _Stop

    def _problems_of(self, error: ValidationError, prefix: tuple[str | int, ...]) -> None:
        for item in error.errors(include_url=False, include_input=False, include_context=False):
            self._problem((*prefix, *_shown_loc(item["loc"])), item["msg"])


def _shown_loc(loc: Iterable[str | int]) -> tuple[str | int, ...]:
    return tuple(part if isinstance(part, int) else _shown_key(part) for part in loc)


def _shown_key(key: str) -> str:
    if _PLAIN_KEY.fullmatch(key):
        return key
    shown = key[:_SHOWN_KEY_CHARS] + ("..." if len(key) > _SHOWN_KEY_CHARS else "")
    return json.dumps(shown, ensure_ascii=True)
