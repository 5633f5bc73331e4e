"""Cyclic garbage collection paused while a plan is computed.

The search allocates hundreds of thousands of small objects that live until it ends (memo
tables, templates, simulated timelines) and almost no reference cycles. Every full collection
rescans all of them for nothing: measured, 0.10 s of a 0.88 s 256-GPU plan and 0.5 s of a
2.8 s 65,536-GPU one. Reference counting still frees acyclic garbage at once; any cycles wait
for the first collection after the plan (peak RSS at 65,536 GPUs: 324 -> 335 MiB).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic collection inside; restored on the way out only if it was enabled on the way in,
    so a caller that disabled it keeps it disabled, and nested or concurrent pauses end enabled."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
