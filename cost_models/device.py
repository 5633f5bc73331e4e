"""A GPU's address in a cluster, and its one text form: `"<node>:<gpu>"` (docs/API.md, "Device ids").

    Device.parse("3:5")            -> Device(node=3, gpu=5)
    str(Device(3, 5))              -> "3:5"
    sorted(ids, key=device_order)  -> numeric order: "2:0" before "10:0"
    DeviceSpec.parse("17:*")       -> every GPU of node 17 (the form `failures.failed` also accepts)

The grammar is strict: ASCII digits only, no sign, no spaces, nothing after the GPU index. Every package
parses and formats device ids here (cost models, planner, detector, wire, adapters, renderers, executor).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

WHOLE_NODE = "*"
_DEVICE = re.compile(r"([0-9]+):([0-9]+)")
_SPEC = re.compile(r"([0-9]+):([0-9]+|\*)")
# Longer than any id of the largest cluster ("16383:71" is 8 characters); int() of a huge digit run is slow.
MAX_DEVICE_ID_CHARS = 24


class DeviceIdError(ValueError):
    """Text that is not a device id; the message quotes it (repr: control characters stay visible)."""


def _match(pattern: re.Pattern[str], text: str, form: str) -> re.Match[str]:
    match = pattern.fullmatch(text) if isinstance(text, str) and len(text) <= MAX_DEVICE_ID_CHARS else None
    if match is None:
        raise DeviceIdError(f"device id {text!r} must look like {form}")
    return match


@dataclass(frozen=True, order=True)
class Device:
    """One GPU: ordered by node, then GPU index, as clusters list them."""

    node: int
    gpu: int

    @classmethod
    def parse(cls, text: str) -> Device:
        match = _match(_DEVICE, text, '"<node>:<gpu>", e.g. "3:5"')
        return cls(int(match.group(1)), int(match.group(2)))

    def __str__(self) -> str:
        return device_id(self.node, self.gpu)


@dataclass(frozen=True)
class DeviceSpec:
    """A device or a whole node (`gpu` None), as `failures.failed` names them."""

    node: int
    gpu: int | None

    @classmethod
    def parse(cls, text: str) -> DeviceSpec:
        match = _match(_SPEC, text, '"<node>:<gpu>" or "<node>:*", e.g. "3:5"')
        return cls(int(match.group(1)), None if match.group(2) == WHOLE_NODE else int(match.group(2)))


def device_id(node: int, gpu: int) -> str:
    """The text form of GPU `gpu` of node `node` (hot: formats every device of 131,072-GPU plans)."""
    return f"{node}:{gpu}"


def device_order(text: str) -> tuple[int, int]:
    """Sort key of a device id: numeric (node, gpu) order."""
    device = Device.parse(text)
    return device.node, device.gpu


def node_of(text: str) -> int:
    return Device.parse(text).node
