"""Loading a ``module.py:function`` handler and running it with its initializer.

Handler modules are loaded only from the functions root (``EMBER_HOME/functions``), where the
gateway stores each function's uploaded code (:mod:`gateway.function_code`); a path that
leads anywhere else, by ``..`` or a symlink, is refused like a missing one.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import logging
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.errors import EmberRuntimeError
from runtime.sdk.context import INIT_ATTRIBUTE, LLM, Context


class HandlerError(EmberRuntimeError):
    """The handler module cannot be loaded, or is not a valid Ember handler."""


@dataclass(frozen=True)
class LoadedHandler:
    handler: Callable[..., Any]
    initializer: Callable[..., Any] | None
    static: bool | None  # the initializer's own choice; None follows the spec


def functions_root() -> Path:
    """Where function code lives: ``EMBER_HOME/functions``."""
    from runtime.registry import ember_home

    return ember_home() / "functions"


def load_handler(ref: str, root: Path | None = None) -> LoadedHandler:
    """Import ``/path/module.py:function`` under a private module name.

    The module must resolve (``os.path.realpath``) inside ``root`` (default:
    :func:`functions_root`); anything else is "not found or not allowed", one message for both.
    """
    path_text, _, fn_name = ref.rpartition(":")
    base = Path(os.path.realpath(root if root is not None else functions_root()))
    path = Path(os.path.realpath(path_text)) if os.path.isabs(path_text) and "\0" not in path_text else None
    if path is None or not path.is_relative_to(base) or path.suffix != ".py" or not path.is_file():
        raise HandlerError(f"handler module not found or not allowed: {path_text}")
    module_name = f"ember_handler_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise HandlerError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling in handlers need the module registered
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise HandlerError(f"importing {path} failed: {type(exc).__name__}: {exc}") from exc
    handler = getattr(module, fn_name, None)
    if not callable(handler):
        raise HandlerError(f"{path} has no function {fn_name!r}")
    inits = [v for v in vars(module).values() if callable(v) and hasattr(v, INIT_ATTRIBUTE)]
    if len(inits) > 1:
        raise HandlerError(f"{path} marks {len(inits)} functions with @init; at most one is allowed")
    initializer = inits[0] if inits else None
    static = getattr(initializer, INIT_ATTRIBUTE)["static"] if initializer else None
    return LoadedHandler(handler, initializer, static)


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    """Await an async function; run a plain one in a thread (it may block on the model)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    return await asyncio.to_thread(fn, *args)


class HandlerRunner:
    """Runs one function's handler: the static initializer once, a dynamic one per request."""

    def __init__(self, loaded: LoadedHandler, spec: dict[str, Any], model: LLM) -> None:
        self.loaded = loaded
        self.spec = spec
        self.model = model
        self.logger = logging.getLogger(f"ember.function.{spec['metadata']['name']}")
        own = loaded.static
        self.static = own if own is not None else spec["spec"].get("init", "static") == "static"
        self._static_state: Any = None

    def _context(
        self, request_id: str, deadline: float, state: Any = None, env: Mapping[str, str] | None = None
    ) -> Context:
        return Context(self.model, self.spec, request_id, self.logger, deadline, state, dict(env or {}))

    async def setup(self, deadline: float) -> None:
        """Run a static initializer (at instance start, before the instance is ready)."""
        if self.loaded.initializer is not None and self.static:
            self._static_state = await _call(self.loaded.initializer, self._context("init", deadline))

    async def invoke(
        self, event: Any, request_id: str, deadline: float, env: Mapping[str, str] | None = None
    ) -> Any:
        """``handler(event, context)``; a dynamic initializer runs first, for this request only.
        ``env``: the request's own environment (:attr:`Context.env`)."""
        state = self._static_state
        if self.loaded.initializer is not None and not self.static:
            state = await _call(self.loaded.initializer, self._context(request_id, deadline, env=env))
        return await _call(self.loaded.handler, event, self._context(request_id, deadline, state, env))
