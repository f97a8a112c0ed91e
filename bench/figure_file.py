"""Writing a drawn figure: the one way every ``bench.plots*`` module saves its PNGs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

DPI = 110


def save(fig: Any, path: Path) -> Path:
    """Lay ``fig`` out, write it to ``path`` as PNG and free it; returns ``path``."""
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
