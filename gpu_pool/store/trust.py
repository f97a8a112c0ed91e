"""Which manifests the daemon believes: it loads only bytes its trusted model store vouches for.

A client's manifest names, per tensor, a content fingerprint and where the bytes are (file,
offset, byte count). The pool shares static tensors across sessions and models by
fingerprint, so it cannot take the client's word for either: a fingerprint claimed for other
bytes would poison every later model that needs it, and a free choice of file would let a
client read anything the daemon can read. :class:`StoreTrust` checks a manifest before
anything is pinned or loaded:

* every tensor's ``file`` must resolve (``os.path.realpath``: symlinks and ``..`` followed) to
  a regular file inside one of the configured store roots;
* a static tensor must be listed under its name in the ``manifest.json`` of the store entry
  holding that file (read with :func:`gpu_pool.store.read`), with the same file, offset,
  nbytes, dtype, shape and fingerprint. :func:`gpu_pool.store.write` computed those
  fingerprints from the bytes, so the bytes the daemon loads are the fingerprint's;
* a dynamic tensor (``static=False``: per-request weights such as adapters) is keyed per
  session by the Reuse Store, so its fingerprint cannot poison anyone else; only the file
  rule applies to it (its bytes need not belong to a registered entry).

The checked manifest names the resolved paths, so the loader opens the file that was checked
even if a symlink on the client's path is changed afterwards. Trust ends at the roots:
whoever can write inside them can register anything, and the loader does not re-hash bytes
(:func:`gpu_pool.store.verify` does that on demand).

With no roots configured every manifest that names a tensor is refused, with a message that
says how to configure one; the daemon still serves ``hello``, ``stats`` and KV blocks.

Cost: store entries are cached keyed by (entry path, dev, inode, size, mtime of their
``manifest.json``), and a manifest that passed is remembered by identity (the daemon's
:class:`gpu_pool.server.manifest_cache.ManifestCache` hands out the same object for the same bytes) with the
signatures it was checked against; a repeated acquire then costs one ``realpath`` and two
``stat`` calls per distinct file, tens of microseconds.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from gpu_pool.errors import UntrustedManifest
from gpu_pool.manifest import Manifest, TensorEntry
from gpu_pool.store import entry as store_entry

# A store entry whose manifest.json was modified less than this long before we looked is read
# again on every check rather than cached. File timestamps are coarse (a kernel tick; seconds
# on some file systems) and inode numbers are reused, so a rewrite that soon after the first
# write can leave (inode, size, mtime) all unchanged. Once the file is older than this, any
# later rewrite moves its mtime, so the signature tells the two apart (racy-git's rule).
RACY_WINDOW_NS = 2_000_000_000

# Tensor fields a static tensor must share with its store entry, in the order they are
# reported ("file" is compared first, on resolved paths).
_CHECKED_FIELDS = ("offset", "nbytes", "dtype", "shape", "fingerprint")

FileSignature = tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns


@dataclass(frozen=True, slots=True)
class _Located:
    """Where one file a manifest names really is, and the signature of its store entry now."""

    real: str  # os.path.realpath of the client's path
    file: FileSignature
    entry: FileSignature | None  # manifest.json beside the file; None where there is none


@dataclass(frozen=True, slots=True)
class _Entry:
    """One store entry as its manifest.json lists it."""

    tensors: dict[str, TensorEntry]
    real_files: dict[str, str]  # file as the entry lists it -> its resolved path


@dataclass(frozen=True, slots=True)
class _Passed:
    """A manifest that passed, and the state of the files it passed against."""

    manifest: Manifest  # held so that its id() is not reused while remembered
    located: tuple[tuple[str, _Located], ...]
    trusted: Manifest


class StoreTrust:
    """Checks client manifests against the model store entries under ``roots`` (see module doc).

    Thread-safe: the daemon runs :meth:`cached` on its event loop and :meth:`check`, which
    may read store entries, in a worker thread.
    """

    def __init__(
        self,
        roots: Iterable[str],
        entry_capacity: int = 1024,
        manifest_capacity: int = 256,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        # Roots are resolved too: a root reached through a symlink holds what its target holds.
        self.roots = tuple(dict.fromkeys(os.path.realpath(r) for r in roots))
        self._prefixes = tuple(r if r.endswith(os.sep) else r + os.sep for r in self.roots)
        self._entry_capacity = entry_capacity
        self._manifest_capacity = manifest_capacity
        self._clock = clock
        self._lock = threading.Lock()  # guards the two caches only, never held during I/O
        self._entries: OrderedDict[tuple[str, FileSignature], _Entry] = OrderedDict()
        self._passed: OrderedDict[int, _Passed] = OrderedDict()

    def cached(self, manifest: Manifest) -> Manifest | None:
        """The trusted form of ``manifest`` if this very object passed before and none of the
        files it was checked against has changed since; ``None`` means: call :meth:`check`."""
        with self._lock:
            passed = self._passed.get(id(manifest))
        if passed is None or passed.manifest is not manifest:
            return None
        for file, was in passed.located:
            try:
                now = self._locate(file)
            except (OSError, UntrustedManifest):
                return None
            if now != was:
                return None
        with self._lock:
            if id(manifest) in self._passed:
                self._passed.move_to_end(id(manifest))
        return passed.trusted

    def check(self, manifest: Manifest) -> Manifest:
        """``manifest`` with every file replaced by its resolved path, once every tensor passed;
        raises :class:`UntrustedManifest` naming the first tensor and field that did not."""
        if not manifest.tensors:
            return manifest  # loads nothing
        with self._lock:  # whatever was remembered is out of date (or it would not be asked)
            self._passed.pop(id(manifest), None)
        if not self.roots:
            raise UntrustedManifest(
                f"this pool has no trusted model store, so it loads no tensors (model "
                f"{manifest.model_id!r} names {len(manifest.tensors)}): start it with --store DIR "
                f"(repeatable) or EMBER_POOL_STORE=DIR[{os.pathsep}DIR...] naming the directories "
                "its models are registered under",
                field="store",
            )
        started = self._clock()
        located: dict[str, _Located] = {}
        entries: dict[str, tuple[_Entry, bool]] = {}  # entry dir -> (entry, cacheable)
        out: list[TensorEntry] = []
        for e in manifest.tensors:
            loc = located.get(e.file)
            if loc is None:
                loc = located[e.file] = self._locate_checked(manifest, e)
            if e.static:
                entry_dir = os.path.dirname(loc.real)
                found = entries.get(entry_dir)
                if found is None:
                    found = entries[entry_dir] = self._entry(manifest, e, entry_dir, loc, started)
                self._compare(manifest, e, loc, entry_dir, found[0])
            out.append(e if e.file == loc.real else replace(e, file=loc.real))
        changed = any(a is not b for a, b in zip(out, manifest.tensors, strict=True))
        trusted = (
            Manifest(manifest.model_id, tuple(out), manifest.latency_sensitivity) if changed else manifest
        )
        if all(cacheable for _, cacheable in entries.values()):
            with self._lock:
                self._passed[id(manifest)] = _Passed(manifest, tuple(located.items()), trusted)
                self._passed.move_to_end(id(manifest))
                while len(self._passed) > self._manifest_capacity:
                    self._passed.popitem(last=False)
        return trusted

    # ----- helpers ------------------------------------------------------------------------------

    def _inside(self, real: str) -> bool:
        return any(real.startswith(p) for p in self._prefixes)

    def _locate(self, file: str) -> _Located:
        """Resolve ``file`` and take the signatures; raises OSError or :class:`UntrustedManifest`
        (without a tensor name: :meth:`_locate_checked` adds one)."""
        real = os.path.realpath(file)
        if not self._inside(real):
            raise UntrustedManifest(f"file {file} resolves to {real}, outside the pool's trusted store")
        st = os.stat(real)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedManifest(f"file {file} ({real}) is not a regular file")
        try:
            est = os.stat(os.path.join(os.path.dirname(real), store_entry.MANIFEST_FILE))
            entry: FileSignature | None = (est.st_dev, est.st_ino, est.st_size, est.st_mtime_ns)
        except FileNotFoundError:
            entry = None
        return _Located(real, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns), entry)

    def _locate_checked(self, manifest: Manifest, e: TensorEntry) -> _Located:
        what = f"tensor {e.name!r} of model {manifest.model_id!r}"
        try:
            return self._locate(e.file)
        except UntrustedManifest as exc:
            roots = ", ".join(self.roots)
            raise UntrustedManifest(f"{what}: {exc} (store roots: {roots})", e.name, "file") from None
        except OSError as exc:
            raise UntrustedManifest(
                f"{what}: cannot open store file {e.file}: {exc.strerror}", e.name, "file"
            ) from None

    def _entry(
        self, manifest: Manifest, e: TensorEntry, entry_dir: str, loc: _Located, started: int
    ) -> tuple[_Entry, bool]:
        """The store entry in ``entry_dir`` (cached unless its manifest.json is racily new)."""
        what = f"tensor {e.name!r} of model {manifest.model_id!r}"
        if loc.entry is None:
            raise UntrustedManifest(
                f"{what}: {e.file} is not part of a model store entry (no {store_entry.MANIFEST_FILE} in "
                f"{entry_dir})",
                e.name,
                "file",
            )
        key = (entry_dir, loc.entry)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit, True
        try:
            listed = store_entry.read(entry_dir)
        except (OSError, ValueError) as exc:  # unreadable, not UTF-8, not JSON, not a manifest
            raise UntrustedManifest(
                f"{what}: {entry_dir} is not a valid model store entry: {exc}", e.name, "file"
            ) from None
        real_files = {f: os.path.realpath(f) for f in {t.file for t in listed.tensors}}
        entry = _Entry({t.name: t for t in listed.tensors}, real_files)
        # The signature was taken before the read, so the content is at least that new; a
        # recent mtime may not yet distinguish a rewrite (see RACY_WINDOW_NS).
        cacheable = loc.entry[3] < started - RACY_WINDOW_NS
        if cacheable:
            with self._lock:
                self._entries[key] = entry
                while len(self._entries) > self._entry_capacity:
                    self._entries.popitem(last=False)
        return entry, cacheable

    @staticmethod
    def _compare(manifest: Manifest, e: TensorEntry, loc: _Located, entry_dir: str, entry: _Entry) -> None:
        what = f"tensor {e.name!r} of model {manifest.model_id!r}"
        listed = entry.tensors.get(e.name)
        if listed is None:
            raise UntrustedManifest(
                f"{what}: store entry {entry_dir} has no tensor of that name", e.name, "name"
            )
        if entry.real_files[listed.file] != loc.real:
            raise UntrustedManifest(
                f"{what}: file {e.file} is not the file store entry {entry_dir} keeps it in ({listed.file})",
                e.name,
                "file",
            )
        for field in _CHECKED_FIELDS:
            mine, theirs = getattr(e, field), getattr(listed, field)
            if mine != theirs:
                raise UntrustedManifest(
                    f"{what}: {field} {mine!r} differs from store entry {entry_dir}, which says {theirs!r}",
                    e.name,
                    field,
                )
