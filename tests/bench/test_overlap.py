"""bench.overlap's one JSON line: the acceptance length's figures on top, the sweep below."""

from __future__ import annotations

import pytest

from bench.overlap import TARGET_RATIO, main, summary


def _row(tokens: int, ratio: float) -> dict[str, object]:
    return {"prompt_tokens": tokens, "model": "m", "model_bytes": 1, "page_cache": "cold",
            "access_order": "traced", "load_threads": 2, "ttft_ratio": ratio, "eq1_ratio": 0.5,
            "target_ratio": TARGET_RATIO, "ok": ratio <= TARGET_RATIO}  # fmt: skip


def test_the_acceptance_figure_is_the_one_at_the_acceptance_length() -> None:
    line = summary([_row(16, 0.5), _row(32, 0.75), _row(64, 0.6)], 32)
    assert line["ttft_ratio"] == 0.75 and line["ok"] is False and line["acceptance_prompt_tokens"] == 32
    assert line["ratio_by_prompt_tokens"] == {16: 0.5, 32: 0.75, 64: 0.6}
    assert [r["prompt_tokens"] for r in line["sweep"]] == [16, 32, 64]
    assert "model" not in line["sweep"][0] and line["model"] == "m"
    assert summary([_row(32, 0.7)], 32)["ok"] is True


@pytest.mark.parametrize(
    "argv", [["--prompt-tokens", "16,x"], ["--prompt-tokens", "16,64"], ["--prompt-tokens", "0,32"]]
)
def test_bad_sweeps_are_refused_before_anything_runs(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        main(argv)
