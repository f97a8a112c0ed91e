"""Process attributes (:mod:`runtime.process`): garbage collection paused on a critical path."""

from __future__ import annotations

import gc

import pytest

from runtime.process import collection_paused


def test_collection_is_paused_inside_and_restored_after_even_on_error() -> None:
    assert gc.isenabled()
    with collection_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collection_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()
    with collection_paused(False):  # not asked to: left as it is
        assert gc.isenabled()
    gc.disable()  # off already (by someone else): left off
    try:
        with collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
