"""bench.turns: Ember and another process measured in turns, one ratio per pair."""

from __future__ import annotations

import itertools

import pytest

from bench import turns


def test_each_pair_gives_one_ratio_and_the_figure_is_their_median(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(turns, "OTHER_SETTLE_S", 0.0)
    calls: list[str] = []
    ours = iter([100.0, 90.0, 120.0])
    theirs = iter([100.0, 100.0, 100.0])

    def ember() -> float:
        calls.append("ember")
        return next(ours)

    def other() -> float:
        calls.append("other")
        return next(theirs)

    out = turns.take_turns(3, ember, other)
    assert calls == ["ember", "other"] * 3  # strictly alternating, Ember first
    assert out["ember"] == [100.0, 90.0, 120.0] and out["other"] == [100.0, 100.0, 100.0]
    assert out["ratios"] == [1.0, 0.9, 1.2]
    assert out["ratio_p50"] == 1.0


def test_the_machine_rests_after_every_turn_of_the_other_process(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(turns.time, "sleep", slept.append)
    counter = itertools.count(1)
    turns.take_turns(2, lambda: float(next(counter)), lambda: 1.0)
    assert slept == [turns.OTHER_SETTLE_S] * 2
