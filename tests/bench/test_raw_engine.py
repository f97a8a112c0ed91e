"""bench.raw_engine: the raw engine's decode on a registered model, as bench.peers runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.raw_engine import measure
from runtime.registry import register
from tests.runtime.tiny_gguf import hf_weights, write_tiny_gguf


def served_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """(home, source): a tiny model registered in ``home``'s store, as a served run leaves it."""
    monkeypatch.setenv("EMBER_MODEL_ROOTS", str(tmp_path))
    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source, hf_weights(3))
    home = tmp_path / "home"
    register(str(source), "bfloat16", home=home)
    return home, source


def interactive(home: Path, source: Path, commands: str) -> subprocess.CompletedProcess[str]:
    args = ["--home", str(home), "--source", str(source), "--dtype", "bfloat16", "--tokens", "6"]
    return subprocess.run(
        [sys.executable, "-m", "bench.raw_engine", "--interactive", *args, "--arena", "64MiB"],
        input=commands,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_measures_decode_on_the_store_of_a_served_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home, source = served_home(tmp_path, monkeypatch)
    result = measure(home, str(source), "bfloat16", tokens=6, runs=2, arena="64MiB")
    assert result["dtype"] == "bfloat16"
    assert isinstance(result["prompt_tokens"], int) and result["prompt_tokens"] > 0
    runs = result["decode_tok_s_runs"]
    assert isinstance(runs, list) and len(runs) == 2 and all(r > 0 for r in runs)


def test_interactive_answers_each_run_line_with_one_decode_and_exits_at_end_of_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    done = interactive(*served_home(tmp_path, monkeypatch), "run\nrun\n")
    assert done.returncode == 0, done.stderr[-2000:]
    ready, *runs = (json.loads(line) for line in done.stdout.splitlines())
    assert ready["event"] == "ready" and ready["prompt_tokens"] > 0 and ready["threads"] >= 1
    assert len(runs) == 2 and all(r["decode_tok_s"] > 0 for r in runs)


def test_interactive_refuses_an_unknown_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    done = interactive(*served_home(tmp_path, monkeypatch), "go\n")
    assert done.returncode == 1
    assert "unknown command 'go'" in done.stderr
    assert json.loads(done.stdout.splitlines()[0])["event"] == "ready"
