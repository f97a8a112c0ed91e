"""Landlock confinement of a worker: handler code cannot read what ``ember serve`` keeps in ``EMBER_HOME``.

Workers run function code with the uid of ``ember serve`` (often root). Dropping to another
uid is not an option: the interpreter may live in a 0700 ``/root`` that another uid cannot
even traverse. Instead a worker drops every capability (:mod:`runtime.worker_limits`: it stays
uid 0 but cannot override file permissions, ptrace or read the memory of the pool or
``ember serve``, signal other uids, mount, change uid or raise its limits) and confines itself
with Linux Landlock, which binds root too. ``EMBER_HOME`` holds ``serve.json`` (the admin API
key), the embedded Redis's files (``redis/``), every instance's logs (``logs/``),
``serve.log`` and the pool sockets. The first layer (:func:`apply`, at worker start, before
any handler code can run):

* reads and writes are handled (``READ_FILE``, ``READ_DIR`` and every right that writes,
  creates, removes, renames or truncates); execs and sockets are left to the ordinary
  permission checks, so handlers still reach the pool;
* everything outside ``EMBER_HOME`` stays readable and writable; inside it ``models/``
  (weights, tokenizers) and ``functions/`` (handler modules) are read-only and ``tmp/`` (the
  workers' ``TMPDIR``) read-write: a handler cannot rewrite another function's module, the
  model store's files, ``serve.json`` or the Redis append-only file;
* from Landlock ABI 6, signals only within the worker (its own process and children): handler
  code cannot kill the pool, ``redis-server``, ``ember serve`` or other workers.

The second layer (:class:`FunctionLayer`, stacked at assignment by
:mod:`runtime.function_sandbox`, before the handler module is imported) handles reads only:
beneath ``functions/`` just the worker's own function's directory
(``functions/NAMESPACE/NAME``, every version of its code) stays readable, so one function's
handler cannot read another's code. Layers intersect: the first layer's rules still hold.
From ABI 8 it binds every thread at once; before, the threads started after it (see
:mod:`runtime.function_sandbox` for the native threads that predate it).

Landlock is an allow-list over directory trees, so "all but one subtree" is one rule per
existing sibling of each directory on the way from ``/`` to ``EMBER_HOME`` (to
``EMBER_HOME/functions`` for the second layer). Consequences (see the README's security
section): those ancestors cannot be listed, entries created *later* directly inside one of
them (say a new ``/tmp/x``) are unreadable to the worker (``TMPDIR`` covers temporary files),
a bind mount or hard link exposing ``EMBER_HOME`` elsewhere stays readable, and ``stat``
(names, sizes) is not hidden, only contents and listings.

What remains shared between the workers of a server (same uid, capabilities or not): ``tmp/``
(read-write for all), ``models/`` (read-only), everything outside ``EMBER_HOME`` that the uid
may read or write (root-owned files included: dropping capabilities does not change file
access by the owner), the network and the pool sockets (the pool checks tickets, not uids),
the embedded Redis's socket (password-protected), and the CPU, memory and devices (only
``RLIMIT_DATA``, when set, bounds one worker's private memory; there is no cgroup).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from runtime.landlock import READS, SCOPE_ABI, SCOPE_SIGNAL, TSYNC_ABI, Ruleset, abi_version, write_rights

log = logging.getLogger(__name__)

SANDBOX_ENV = "EMBER_WORKER_SANDBOX"  # "on" (default) or "off"
REQUIRE_ENV = "EMBER_REQUIRE_SANDBOX"  # "1": a worker without Landlock refuses to start
READABLE = ("models", "functions", "tmp")  # the parts of EMBER_HOME a worker may read
WRITABLE = ("tmp",)  # ... and of those, the ones it may write
MAX_RULES = 4096  # siblings of EMBER_HOME's ancestors (an unbounded /tmp must not stall starts)


class SandboxError(RuntimeError):
    """The sandbox could not be applied although it was required (or it failed half-way)."""

    code = "sandbox_failed"


@dataclass(frozen=True, slots=True)
class SandboxConfig:
    """Whether workers confine themselves, and whether a kernel without Landlock is fatal."""

    enabled: bool = True
    required: bool = False

    def __post_init__(self) -> None:
        if self.required and not self.enabled:
            raise ValueError(f"{REQUIRE_ENV}=1 contradicts {SANDBOX_ENV}=off")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SandboxConfig:
        """``EMBER_WORKER_SANDBOX`` (on/off) and ``EMBER_REQUIRE_SANDBOX`` (0/1); other values raise."""
        env = os.environ if env is None else env
        enabled = _choice(env, SANDBOX_ENV, {"on": True, "off": False}, "on")
        required = _choice(env, REQUIRE_ENV, {"1": True, "0": False}, "0")
        return cls(enabled, required)


@dataclass(frozen=True, slots=True)
class SandboxReport:
    """What :func:`apply` did: ``abi`` is the kernel's Landlock ABI (0: none), ``reason`` why not applied."""

    applied: bool
    abi: int
    rules: int = 0
    reason: str | None = None
    all_threads: bool = False  # the function layer reached every thread (ABI 8), not only the caller


def _choice(env: Mapping[str, str], name: str, values: dict[str, bool], default: str) -> bool:
    raw = env.get(name, default).strip().lower() or default
    if raw not in values:
        raise ValueError(f"{name}={raw!r}: expected one of {', '.join(values)}")
    return values[raw]


def temp_dir(home: Path) -> Path:
    """The workers' ``TMPDIR`` (``EMBER_HOME/tmp``, 0700), created if missing."""
    path = Path(os.path.realpath(home)) / "tmp"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def _readable_dirs(home: Path) -> list[Path]:
    # Created now if missing (0700, like the rest of EMBER_HOME): a rule needs an existing
    # directory, and a pre-warmed worker starts before the first deploy creates functions/.
    dirs = [Path(os.path.realpath(home)) / name for name in READABLE]
    for path in dirs:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return [Path(os.path.realpath(path)) for path in dirs]  # an operator's symlinked store is followed


def readable_roots(target: Path) -> list[Path]:
    """Siblings of ``target``'s ancestors: "all but ``target``" as rules (what a sandboxed worker
    may read beneath outside EMBER_HOME, or outside the functions root)."""
    target = Path(os.path.realpath(target))
    roots: list[Path] = []
    for ancestor in reversed(target.parents):  # "/" first
        on_path = target.parts[len(ancestor.parts)]
        try:
            names = sorted(os.listdir(ancestor))
        except OSError as exc:
            raise SandboxError(f"cannot list {ancestor} to confine the worker: {exc}") from exc
        roots += [ancestor / name for name in names if name != on_path]
        if len(roots) > MAX_RULES:
            raise SandboxError(f"more than {MAX_RULES} entries beside {target}'s ancestors")
    return roots


def _unavailable(config: SandboxConfig) -> SandboxReport:
    """No Landlock here: a warning (the worker runs unconfined), or :class:`SandboxError` if required."""
    reason = "this kernel has no Landlock (or it is disabled)"
    if config.required:
        raise SandboxError(f"{reason}, and {REQUIRE_ENV}=1")
    log.warning("worker runs unconfined: %s; handlers can read EMBER_HOME", reason)
    return SandboxReport(False, 0, reason=reason)


def apply(home: Path, config: SandboxConfig | None = None) -> SandboxReport:
    """Confine the calling process's reads and writes (see module docstring); irreversible.

    Call it while the process has one thread: Landlock restricts only the calling thread and
    the threads it creates later, so an older thread would stay free. Without Landlock the
    worker logs a warning and runs unconfined, unless ``config.required`` (then it raises).
    """
    config = config or SandboxConfig()
    if not config.enabled:
        return SandboxReport(False, 0, reason=f"{SANDBOX_ENV}=off")
    abi = abi_version()
    if abi == 0:
        return _unavailable(config)
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        raise SandboxError(f"the sandbox must be applied before any thread starts ({threads} running)")
    inside, outside = _readable_dirs(home), readable_roots(home)
    writes = write_rights(abi)
    # From ABI 6 also no signals to processes outside the worker's domain: handler code (same
    # uid) must not kill the pool, redis-server, ember serve or another function's worker.
    scoped = SCOPE_SIGNAL if abi >= SCOPE_ABI else 0
    try:
        with Ruleset(READS | writes, scoped) as ruleset:
            rules = sum(
                ruleset.allow(path, READS | (writes if name in WRITABLE else 0), follow=True)
                for name, path in zip(READABLE, inside, strict=True)
            )
            rules += sum(ruleset.allow(path, READS | writes, follow=False) for path in outside)
            ruleset.restrict_self()
    except OSError as exc:
        raise SandboxError(f"Landlock failed: {exc}") from exc
    log.info("worker confined by Landlock ABI %d: %d rules, %s unreadable but %s", abi, rules, home, READABLE)
    return SandboxReport(True, abi, rules)


class FunctionLayer:
    """The second layer: beneath the functions root, only one function's directory stays
    readable; everything else keeps what the first layer allows.

    Built by :meth:`prepare` before the first layer (which makes the functions root's ancestors
    unlistable), at worker start; enforced once, by :meth:`restrict`, when the worker learns its
    function (then only that directory's rule is added: the assignment pays for one rule, not
    for a rule per entry beside EMBER_HOME's ancestors).
    """

    def __init__(
        self, root: Path, config: SandboxConfig, abi: int, ruleset: Ruleset | None, rules: int
    ) -> None:
        self.root = root  # realpath of EMBER_HOME/functions
        self.config = config
        self.abi = abi
        self._ruleset = ruleset
        self._rules = rules

    @classmethod
    def prepare(cls, home: Path, config: SandboxConfig | None = None) -> FunctionLayer:
        """Call before :func:`apply`: the ruleset's rules name what lies beside the directories
        from ``/`` to the functions root. Only reads are handled: writes stay as the first
        layer has them (none beneath ``functions/``)."""
        config = config or SandboxConfig()
        _readable_dirs(home)  # functions/ exists (a rule needs it), as apply() makes sure too
        root = Path(os.path.realpath(Path(home) / "functions"))
        abi = abi_version() if config.enabled else 0
        if abi == 0:
            return cls(root, config, abi, None, 0)
        beside = readable_roots(root)
        try:
            ruleset = Ruleset(READS)
        except OSError as exc:
            raise SandboxError(f"Landlock failed: {exc}") from exc
        try:
            rules = sum(ruleset.allow(path, READS, follow=False) for path in beside)
        except OSError as exc:
            ruleset.close()
            raise SandboxError(f"Landlock failed: {exc}") from exc
        return cls(root, config, abi, ruleset, rules)

    def function_dir(self, namespace: str, name: str) -> Path:
        """Where the gateway stores the code of function ``name`` in ``namespace``
        (``gateway.function_code``: ``functions/NAMESPACE/NAME``, ``default`` for plain names)."""
        for part in (namespace, name):
            if not part or len(part) > 63 or part in (".", "..") or "/" in part or "\0" in part:
                raise SandboxError(f"function {namespace}/{name}: not a namespace and name")
        return self.root / namespace / name

    def restrict(self, own: Path) -> SandboxReport:
        """Enforce the layer with ``own`` (a function's directory) readable, on the calling
        thread and the threads it starts from now on (from ABI 8: on every thread). Once only;
        irreversible. Without Landlock: as :func:`apply` (a warning, or an error if required)."""
        if not self.config.enabled:
            return SandboxReport(False, 0, reason=f"{SANDBOX_ENV}=off")
        if self.abi == 0:
            return _unavailable(self.config)
        if own.parent.parent != self.root:
            raise SandboxError(f"{own} is not a function's directory under {self.root}")
        ruleset, self._ruleset = self._ruleset, None
        if ruleset is None:
            raise SandboxError("the function layer was already enforced")
        all_threads = self.abi >= TSYNC_ABI
        try:
            rules = self._rules + ruleset.allow(own, READS, follow=False)  # none while it has no code
            ruleset.restrict_self(all_threads)
        except OSError as exc:
            raise SandboxError(f"Landlock failed: {exc}") from exc
        finally:
            ruleset.close()
        log.info("worker confined to %s (Landlock ABI %d, all threads %s)", own, self.abi, all_threads)
        return SandboxReport(True, self.abi, rules, all_threads=all_threads)
