"""Text that reaches a shell: plan-supplied strings made inert, and the settings a launch still needs.

A plan is data a client sent (or crafted: `resiplan export PLAN.json` reads any file), so its free text
(plan_id, the model's name) never reaches a shell as it is. Exports quote every argument with
shlex.quote; what goes into a `# comment` or a `"${VAR:?message}"` is first passed through `inert`,
which keeps a printable ASCII subset that neither context acts on: no line break of any kind (a
newline ends a comment), no `$`, backtick, quote, backslash or `}` (expanded or ending the message).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

_NOT_INERT = re.compile(r"[^A-Za-z0-9 ._+/:@=,()-]")
MAX_INERT_CHARS = 160


def inert(text: str) -> str:
    """`text` with every character outside [A-Za-z0-9 ._+/:@=,()-] replaced by `_`, at most 160 characters."""
    cleaned = _NOT_INERT.sub("_", text)
    return cleaned if len(cleaned) <= MAX_INERT_CHARS else cleaned[:MAX_INERT_CHARS - 3] + "..."


@dataclass(frozen=True)
class Required:
    """A setting the plan does not know and the trainer cannot run without, as a shell placeholder.

    flag: the trainer's option; variable: the environment variable the printed command reads it from;
    meaning: what to put there (shown by bash when the variable is unset, so the command stops there).
    """

    flag: str
    variable: str
    meaning: str

    def __post_init__(self) -> None:
        # these are the project's own constants; a character inert() would replace is a typo to fix here
        if inert(self.meaning) != self.meaning or not re.fullmatch(r"[A-Z][A-Z0-9_]*", self.variable):
            raise ValueError(f"setting {self.variable!r}: its message must be inert text, its name a variable")

    def value(self) -> str:
        """`"${VARIABLE:?set VARIABLE to meaning}"`: the variable's value, or bash stops with the message."""
        return f'"${{{self.variable}:?set {self.variable} to {inert(self.meaning)}}}"'

    def words(self) -> str:
        """The flag and its value (just the value for a positional setting, whose flag is empty)."""
        return f"{self.flag} {self.value()}" if self.flag else self.value()


def required_lines(settings: Sequence[Required]) -> list[str]:
    """Comment lines listing what must be set before the command runs."""
    if not settings:
        return []
    lines = ["# still to set (the command stops with a message while one is unset):"]
    lines += [f"#   {setting.variable}: {inert(setting.meaning)}" + (f" ({setting.flag})" if setting.flag else "")
              for setting in settings]
    return lines


def required_summary(settings: Sequence[Required]) -> str:
    """One line for people, e.g. on stderr: which variables the printed command needs."""
    names = ", ".join(setting.variable for setting in settings)
    return f"set {names} before running it: it stops, naming the first one unset (its comments say what each is)"
