"""Handler modules load only from the functions root: no ``..``, no path outside, no symlink out,
and one message whether a module is missing or refused."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from runtime.sdk.handler import HandlerError, load_handler

MODULE = "async def handler(event, context):\n    return event\n"


def test_handler_modules_load_only_from_the_functions_root(tmp_path: Path) -> None:
    root = tmp_path / "functions"
    own = root / "echo" / "abc"
    own.mkdir(parents=True)
    (own / "echo.py").write_text(MODULE)
    outside = tmp_path / "outside.py"
    outside.write_text(MODULE)
    (own / "link.py").symlink_to(outside)  # a symlink out of the root
    assert load_handler(f"{own / 'echo.py'}:handler", root).handler is not None
    refused = [
        f"{outside}:handler",  # exists, outside the root
        f"{own}/../../../outside.py:handler",  # `..` out of the root
        f"{own / 'link.py'}:handler",
        f"{json.__file__}:loads",  # any module of the server's Python
        "echo.py:handler",  # relative
        f"{own / 'missing.py'}:handler",  # inside, missing: the same answer
    ]
    for ref in refused:
        path_text = ref.rpartition(":")[0]
        message = f"handler module not found or not allowed: {path_text}"
        with pytest.raises(HandlerError, match=f"^{re.escape(message)}$"):
            load_handler(ref, root)


def test_the_default_root_is_ember_home_functions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_HOME", str(tmp_path))
    module = tmp_path / "functions" / "echo" / "abc" / "echo.py"
    module.parent.mkdir(parents=True)
    module.write_text(MODULE)
    assert load_handler(f"{module}:handler").initializer is None
    other = tmp_path / "elsewhere.py"
    other.write_text(MODULE)
    with pytest.raises(HandlerError, match="not found or not allowed"):
        load_handler(f"{os.fspath(other)}:handler")
