from __future__ import annotations

import gc

import pytest

from planner.gc_pause import gc_paused


def test_paused_inside_and_restored_after():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_restored_after_an_error():
    with pytest.raises(ValueError), gc_paused():
        raise ValueError("boom")
    assert gc.isenabled()


def test_a_caller_that_disabled_it_keeps_it_disabled():
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
