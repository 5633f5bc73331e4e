"""What every importer of a trainer's settings shares: the words of a pasted command line as a shell splits
them (never run), torchrun's replica count, and the form of an import's answer."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from planner.errors import PlanningError

# Shell operators between commands: what follows one is another command.
SEPARATORS = ";&|"


class CommandLineError(PlanningError):
    """Settings that do not describe a job resiplan can estimate; the message says why."""


@dataclass
class Imported:
    """What a trainer's settings say: the request (a `/v1/estimate` body without its cluster, which settings do
    not name), the settings that change time or memory but are not modelled, each with why, and those ignored
    because they change neither (learning rate, paths, logging)."""

    request: dict
    not_modelled: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def command_words(text: str) -> tuple[list[str], list[str]]:
    """The words of a pasted command line as a shell splits them (quotes, escapes, line continuations,
    comments), each `--flag=value` as two words: the launcher's, before the training entry point (a `.py`
    script, or the module after `-m`), and the entry point's own; a text without one is all its own. What
    follows a `;`, `&&` or `|` is another command and is left out."""
    lexer = shlex.shlex(text.replace("\\\n", " "), posix=True, punctuation_chars=SEPARATORS)
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError as error:  # an unclosed quote
        raise CommandLineError(f"the command line does not parse as a shell would: {error}") from None
    out = []
    for word in words:
        out += word.split("=", 1) if word.startswith("--") and "=" in word else [word]
    entries = [i for i, word in enumerate(out) if word.endswith(".py") or (i > 0 and out[i - 1] == "-m")]
    if not entries:
        return [], _one_command(out)
    launcher = out[:entries[-1]]
    starts = [i for i, word in enumerate(launcher) if _separator(word)]
    return launcher[starts[-1] + 1:] if starts else launcher, _one_command(out[entries[-1] + 1:])


def world_size(launcher: list[str]) -> int | None:
    """Ranks torchrun starts (--nnodes x --nproc-per-node), None when the launcher words do not say."""
    values = {}
    for i, word in enumerate(launcher[:-1]):
        if word.startswith("--"):
            values[word.replace("_", "-")] = launcher[i + 1]
    per_node, nodes = values.get("--nproc-per-node"), values.get("--nnodes", "1")
    if per_node is None or not per_node.isdigit() or not nodes.isdigit():
        return None
    return int(per_node) * int(nodes)


def _separator(word: str) -> bool:
    return bool(word) and set(word) <= set(SEPARATORS)


def _one_command(words: list[str]) -> list[str]:
    for i, word in enumerate(words):
        if _separator(word):
            return words[:i]
    return words
