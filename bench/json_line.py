"""The one JSON line every benchmark prints, also appended to a file for ``bench.plots``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(line: dict[str, Any], out: Path | None) -> None:
    """Print ``line`` as one JSON line; append it to ``out`` too when given."""
    text = json.dumps(line)
    print(text)
    if out is not None:
        with out.open("a") as f:
            f.write(text + "\n")
