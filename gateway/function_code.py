"""Function code: the handler module a custom function runs, kept in the function's directory.

A custom handler (``spec.handler: module.py:function``) never names an arbitrary file of the
server. ``ember deploy -f`` uploads the module's source with the spec (a JSON body
``{"function": SPEC, "files": {"module.py": SOURCE}}``); the gateway checks it (a bounded
UTF-8 Python module that compiles), writes it to
``FUNCTIONS_ROOT/<name>/<digest>/module.py`` (directories 0700, files 0600, written beside
and renamed into place) and rewrites the handler to that path, which is what workers load
(:func:`runtime.sdk.handler.load_handler` refuses anything outside the functions root).
The directory is content-addressed, so a redeploy with new code is a new spec (old instances
are retired) and never rewrites a module a running instance was loaded from.

An operator's own modules may instead be named by absolute path when they lie under a
configured handler root (``EMBER_HANDLER_ROOTS``, compared after ``os.path.realpath``): the
gateway copies them in the same way. Anything else (``..``, another absolute path, a symlink
out, a module that does not exist) gets one message, whichever the case, so a deployer
cannot probe the server's files.

In cluster mode the stored module reaches the worker pods as a ConfigMap
(:mod:`scheduler.knative.handler_code`, whose digest names the directory here):
:func:`read_stored` reads it back for rendering, :func:`local_handler_code` reads the one
beside a YAML for ``ember deploy --target knative``.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.storage import storage_full
from scheduler.knative.handler_code import MAX_MODULE_BYTES, HandlerCode, code_digest, split_ref
from scheduler.knative.handler_code import MODULE_NAME as _MODULE_NAME
from scheduler.spec import SpecError

__all__ = [
    "HANDLER_ROOTS_ENV", "MAX_FILES", "MAX_MODULE_BYTES", "FunctionCodeConfig", "local_handler_code",
    "not_allowed", "read_stored", "split_upload", "store_handler", "with_handler_module",
]  # fmt: skip
HANDLER_ROOTS_ENV = "EMBER_HANDLER_ROOTS"
MAX_FILES = 1  # the handler module itself (helpers belong in an installed package)
_TMP_PREFIX = ".tmp-"
_FUNCTION_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # DNS-1123 label, as specs


@dataclass(frozen=True, slots=True)
class FunctionCodeConfig:
    """Where function code is stored (``root``) and the operator's handler roots."""

    root: Path  # EMBER_HOME/functions
    handler_roots: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        for path in (self.root, *self.handler_roots):
            if not path.is_absolute():
                raise ValueError(f"function code path {path} must be absolute")

    @classmethod
    def from_env(cls, home: Path, env: Mapping[str, str] | None = None) -> FunctionCodeConfig:
        """``home/functions``; ``EMBER_HANDLER_ROOTS``: colon-separated absolute directories."""
        from runtime.sources import parse_roots

        return cls(Path(os.path.realpath(home)) / "functions", parse_roots(HANDLER_ROOTS_ENV, env))

    def function_dir(self, name: str) -> Path:
        """The directory of function ``name``'s code: ``NAME`` (namespace ``default``) or
        ``NAMESPACE/NAME``, each part a DNS-1123 label (so never ``..`` or an absolute path)."""
        parts = name.split("/")
        if len(parts) > 2 or not all(_FUNCTION_NAME.match(part) for part in parts):
            raise ValueError(f"function id {name!r} is not NAME or NAMESPACE/NAME (DNS-1123 labels)")
        # Plain names live in namespace "default": a default function named like a namespace
        # must not share (or on delete, remove) that namespace's directory.
        return self.root.joinpath(*(["default", *parts] if len(parts) == 1 else parts))

    def remove(self, name: str) -> None:
        """Delete function ``name``'s stored code (after the function was deleted)."""
        shutil.rmtree(self.function_dir(name), ignore_errors=True)


def not_allowed(handler: str) -> SpecError:
    """The one error for a handler module that is missing *or* not allowed."""
    return SpecError(
        f"spec.handler: handler module not found or not allowed: {handler} (upload it with the spec: "
        f"`ember deploy -f FILE.yaml` sends the module beside the YAML)"
    )


def split_upload(data: Any) -> tuple[Any, dict[str, str]]:
    """``(spec, files)`` of a JSON deploy body: a bare spec, or ``{"function", "files"}``."""
    if not isinstance(data, dict) or "function" not in data:
        return data, {}
    extra = set(data) - {"function", "files"}
    if extra:
        raise SpecError(f"unknown fields beside 'function' and 'files': {sorted(extra)}")
    files = data.get("files", {})
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise SpecError("files: expected an object of module name -> source text")
    if len(files) > MAX_FILES:
        raise SpecError(f"files: at most {MAX_FILES} module (the handler's) may be uploaded")
    return data["function"], dict(files)


def store_handler(config: FunctionCodeConfig | None, name: str, handler: str, files: dict[str, str]) -> str:
    """The handler reference workers load for function ``name``: ``default``, or the stored
    module's absolute path and function. Raises :class:`SpecError` (HTTP 400)."""
    if handler == "default":
        if files:
            raise SpecError("files: the default handler takes no modules (set spec.handler)")
        return handler
    module_text, _, function = handler.rpartition(":")
    if config is None:
        raise not_allowed(handler)
    module_name = os.path.basename(module_text)
    if not _MODULE_NAME.match(module_name):
        raise SpecError(f"spec.handler: {module_name!r} is not a plain module file name (letters, digits, _)")
    if files:
        if set(files) != {module_name} or module_text != module_name:
            raise SpecError(f"files: expected exactly the handler's module {module_text!r}")
        source = files[module_name]
    else:
        source = _read_from_roots(config, name, module_text, handler)
    try:
        encoded = source.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates from a JSON \ud800 escape
        raise SpecError(f"files: {module_name} is not valid UTF-8") from None
    if len(encoded) > MAX_MODULE_BYTES:
        raise SpecError(f"files: {module_name} is larger than {MAX_MODULE_BYTES} bytes")
    _check_python(module_name, source)
    try:
        path = _write(config.function_dir(name), module_name, encoded)
    except OSError as exc:
        full = storage_full(exc, f"the handler module {module_name}")
        if full is None:
            raise
        raise full from None
    return f"{path}:{function}"


def with_handler_module(document: Any, spec_file: Path) -> Any:
    """The deploy body for ``document`` read from ``spec_file`` (client side, ``ember deploy``):
    the spec itself for the default handler, else ``{"function", "files"}`` with the handler's
    module (a path relative to the YAML's directory, or absolute) read and uploaded."""
    spec = document.get("spec") if isinstance(document, dict) else None
    if not isinstance(spec, dict):
        return document  # the gateway validates what is left
    handler = spec.get("handler")
    if not isinstance(handler, str) or handler == "default" or ":" not in handler:
        return document
    module_text, _, function = handler.rpartition(":")
    path = spec_file.resolve().parent / module_text
    if path.stat().st_size > MAX_MODULE_BYTES:
        raise ValueError(f"{path} is larger than {MAX_MODULE_BYTES} bytes")
    source = path.read_text(encoding="utf-8")
    function_spec = {**document, "spec": {**spec, "handler": f"{path.name}:{function}"}}
    return {"function": function_spec, "files": {path.name: source}}


def read_stored(config: FunctionCodeConfig | None, function_id: str, handler: str) -> HandlerCode:
    """The module a stored function's handler names (what cluster mode renders as a
    ConfigMap): it must lie in the function's own code directory. :class:`SpecError` else."""
    module, function = split_ref(handler)
    if config is None:
        raise not_allowed(handler)
    path = Path(os.path.realpath(handler.rpartition(":")[0]))
    if not path.is_relative_to(os.path.realpath(config.function_dir(function_id))) or not path.is_file():
        raise not_allowed(handler)
    try:
        with open(path, "rb") as f:
            encoded = f.read(MAX_MODULE_BYTES + 1)
        source = encoded.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        raise not_allowed(handler) from None
    if len(encoded) > MAX_MODULE_BYTES:
        raise SpecError(f"spec.handler: the module is larger than {MAX_MODULE_BYTES} bytes")
    return HandlerCode(module, function, source)


def local_handler_code(document: Any, spec_file: Path) -> HandlerCode | None:
    """The handler module of ``document`` read from beside ``spec_file`` (``ember deploy
    --target knative``, no gateway); None for the default handler. :class:`SpecError` for a
    module that cannot be read."""
    try:
        body = with_handler_module(document, spec_file)
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise SpecError(f"spec.handler: cannot read its module beside {spec_file.name}: {exc}") from None
    if body is document:
        return None
    (module, source), function = next(iter(body["files"].items())), body["function"]["spec"]["handler"]
    return HandlerCode(module, split_ref(function)[1], source)


def _read_from_roots(config: FunctionCodeConfig, name: str, module_text: str, handler: str) -> str:
    """An absolute module path under a handler root (or this function's own stored code)."""
    if not os.path.isabs(module_text) or "\0" in module_text:
        raise not_allowed(handler)
    real = Path(os.path.realpath(module_text))
    roots = (*config.handler_roots, Path(os.path.realpath(config.function_dir(name))))
    if not any(real.is_relative_to(root) for root in roots) or not real.is_file():
        raise not_allowed(handler)
    try:
        if real.stat().st_size > MAX_MODULE_BYTES:
            raise SpecError(f"spec.handler: the module is larger than {MAX_MODULE_BYTES} bytes")
        return real.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        raise not_allowed(handler) from None


def _check_python(module_name: str, source: str) -> None:
    if "\0" in source:
        raise SpecError(f"files: {module_name} contains a NUL character")
    try:
        compile(source, module_name, "exec", dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise SpecError(f"files: {module_name} is not valid Python: {type(exc).__name__}: {exc}") from None


def _write(directory: Path, module_name: str, encoded: bytes) -> Path:
    """Write the module into ``directory/<digest>/`` once (0700/0600), atomically."""
    digest = code_digest(module_name, encoded)
    final = directory / digest
    if not (final / module_name).is_file():
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        tmp = directory / f"{_TMP_PREFIX}{digest}-{os.getpid()}-{os.urandom(4).hex()}"
        tmp.mkdir(mode=0o700)
        try:
            fd = os.open(tmp / module_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(encoded)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.rename(tmp, final)
            except OSError:  # a concurrent deploy of the same code won: its copy is identical
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final / module_name
