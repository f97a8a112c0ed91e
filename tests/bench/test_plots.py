"""bench.plots draws every figure from real benchmark lines (quick runs) and refuses foreign ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import tangram, zoo
from bench.plots import draw, newest


def test_figures_from_quick_runs_of_the_pool_benchmarks(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for figure in (10, 12):
        line = tangram.run(figure, quick=True)
        (data / f"tangram_fig{figure}.jsonl").write_text(json.dumps(line) + "\n")
    zoo.main(
        [
            "--profile",
            "quick",
            "--root",
            str(tmp_path / "zoo"),
            "--dedup",
            "--out",
            str(data / "zoo_dedup.jsonl"),
        ]
    )
    written = draw(data, tmp_path / "figures")  # no trace.jsonl: its figures are skipped
    assert sorted(p.name for p in written) == ["tangram_fig10.png", "tangram_fig12.png", "zoo_dedup.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_a_line_of_another_benchmark_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps({"bench": "tangram", "figure": 10}) + "\n")
    with pytest.raises(ValueError, match="expected a 'trace' line"):
        newest(path, "trace")
    path.write_text("\n")
    with pytest.raises(ValueError, match="no JSON line"):
        newest(path, "trace")


def test_issue_16_figures_from_the_committed_measurements(tmp_path: Path) -> None:
    """bench.mesh / bench.overlap / bench.lora lines as measured (docs/figures/data) draw."""
    data = Path(__file__).resolve().parents[2] / "docs" / "figures" / "data"
    picked = tmp_path / "data"
    picked.mkdir()
    for name in ("mesh.jsonl", "overlap.jsonl", "lora.jsonl"):
        (picked / name).write_text((data / name).read_text())
    written = draw(picked, tmp_path / "figures")
    assert sorted(p.name for p in written) == ["mesh_capacity.png", "tidal_lora.png", "tidal_overlap.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
