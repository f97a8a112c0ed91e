"""Figures of the pool benchmarks (Tangram Fig. 10 and 12, fine-tune dedup) for :mod:`bench.plots`."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_fig10(data: dict[str, Any], out: Path) -> list[Path]:
    raise NotImplementedError


def plot_fig12(data: dict[str, Any], out: Path) -> list[Path]:
    raise NotImplementedError


def plot_dedup(data: dict[str, Any], out: Path) -> list[Path]:
    raise NotImplementedError
