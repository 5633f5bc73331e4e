"""The named choices a layout makes, as values the cost models and the planner share (`StrEnum`: each member
is its wire string, so `Recompute.FULL == "full"` and JSON carries "full")."""

from __future__ import annotations

from enum import StrEnum


class Recompute(StrEnum):
    """Activation recomputation: keep everything; recompute core attention (Korthikanti et al.'s selective);
    keep only each layer's input and recompute the layer (full)."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class ScheduleName(StrEnum):
    """Pipeline schedules: GPipe, 1F1B, interleaved 1F1B (v model chunks per stage), the zero-bubble ZB-H1
    and ZB-H2 (backward split into input- and weight-gradient ops), breadth-first looped pipelining (v chunks per
    stage, each chunk running all its microbatches before the next), and resiplan's CP-SAT schedule."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZB_H1 = "zb-h1"
    ZB_H2 = "zb-h2"
    LOOPED_BFS = "looped-bfs"
    OPTIMIZED = "optimized"
