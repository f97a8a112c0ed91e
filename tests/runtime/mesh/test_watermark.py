"""Watermark KV scaling (Eq. 2) and the reservation station (LLM-Mesh §6)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.mesh.watermark import Outcome, ReservationStation, Watermark


def test_eq_2_uses_the_average_output_and_the_minimum_length() -> None:
    w = Watermark(bytes_per_token=100, w=0.2, min_tokens=50)
    assert w.require([(10, 2), (20, 30)], avg_out=8) == 100 * (10 + 8 + 20 + 30)
    assert w.require([(1, 0)], avg_out=1) == 100 * 50  # L_min
    assert w.recommend(1000) == 1200


def test_scales_up_early_and_down_lazily() -> None:
    w = Watermark(bytes_per_token=1, w=0.25, min_tokens=0)
    assert w.target(current=900, require=1000) == 1250  # short: up to recommend at once
    assert w.target(current=1250, require=1000) is None  # holds
    assert w.target(current=1500, require=1000) is None  # 1250 * 1.25 = 1562 > 1500: lazy
    assert w.target(current=1600, require=1000) == 1250  # far above: down to recommend


def test_a_grow_waits_for_a_shrink_that_frees_its_room() -> None:
    st_ = ReservationStation(capacity=100, sizes={"a": 60, "b": 40})
    assert st_.resize("a", 20) is Outcome.ISSUED  # shrink: runs at once, a still holds 60
    assert st_.resize("b", 80) is Outcome.QUEUED  # fits the optimistic budget, not what is held
    assert st_.held() == 100 and st_.budget() == 100
    assert st_.complete("a") == ["b"]  # a's memory is back: b's grow is issued now
    assert st_.held() == 100
    st_.complete("b")
    assert st_.sizes == {"a": 20, "b": 80}


def test_refuses_what_even_the_optimistic_budget_cannot_hold() -> None:
    st_ = ReservationStation(capacity=100, sizes={"a": 60})
    assert not st_.can_resize("b", 50)
    assert st_.resize("b", 50) is Outcome.REFUSED
    assert st_.resize("b", 40) is Outcome.ISSUED


def test_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError):
        Watermark(bytes_per_token=0)
    with pytest.raises(ValueError):
        ReservationStation(capacity=10).resize("a", -1)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("resize"), st.sampled_from("abc"), st.integers(0, 120)),
            st.tuples(st.just("complete"), st.sampled_from("abc"), st.just(0)),
            st.tuples(st.just("remove"), st.sampled_from("abc"), st.just(0)),
        ),
        max_size=40,
    )
)
def test_what_is_held_never_exceeds_the_capacity(ops: list[tuple[str, str, int]]) -> None:
    """Hazard freedom: at every moment, the memory held (instances being resized at the larger
    of both sizes) fits the device, and the optimistic budget too."""
    station = ReservationStation(capacity=100)
    for op, inst, size in ops:
        if op == "resize":
            station.resize(inst, size)
        elif op == "complete" and inst in station._running:
            station.complete(inst)
        elif op == "remove":
            station.remove(inst)
        assert station.held() <= station.capacity
        assert station.budget() <= station.capacity
