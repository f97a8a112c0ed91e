"""runtime.instance: what an instance's start imports."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
import runtime.worker  # what a pre-warmed worker has imported before any assignment
from runtime.instance import load_adapters
assert "runtime.adapters" not in sys.modules, "already imported: the probe proves nothing"
assert load_adapters(()) == ()
# A function without adapters must not import them on its cold start (~2 ms on 2 cores).
assert "runtime.adapters" not in sys.modules
"""


def test_a_start_without_adapters_imports_no_adapter_code() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
