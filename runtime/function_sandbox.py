"""Confining an assigned worker to its own function's code: the sandbox's second layer.

A pre-warmed worker is confined by :func:`runtime.sandbox.apply` before it knows its function,
so it may read every function's code under ``EMBER_HOME/functions``. At assignment, before
the handler module is imported, :meth:`FunctionSandbox.confine` stacks a Landlock layer under
which only that function's directory (``functions/NAMESPACE/NAME``) stays readable there.

Landlock binds the calling thread and the threads it starts later; from ABI 8 the layer is
enforced on every thread at once. Before that, threads that already run could still read other
functions' code, so the layer is stacked on the event loop's thread (where async handlers run
and every later thread is started from) and the worker's thread pool (where sync handlers run)
is replaced: the old pool's threads end, the new ones are started under the layer. A Python
thread that predates the layer and still runs afterwards fails the assignment. Native threads
that predate it (torch's OpenMP pool) keep only the first layer before ABI 8: they run no
Python, but handler code that corrupts the process's memory could make one read for it.

A worker is one function's for the rest of its life: the agent stops (never reassigns) it when
its instance ends or its assignment fails, and a worker confined to one function refuses any
other (:class:`ConfinedElsewhere`).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from runtime.intra_op import serial_thread
from runtime.sandbox import FunctionLayer, SandboxError, SandboxReport

_POOL_PREFIX = "ember-worker"


class ConfinedElsewhere(SandboxError):
    """The worker is already confined to another function's code (the assignment is refused)."""

    code = "confined_to_another_function"


def function_id(spec: dict[str, Any]) -> tuple[str, str]:
    """``(namespace, name)`` of a function spec document (namespace ``default`` when absent)."""
    meta = spec["metadata"]
    return str(meta.get("namespace", "default")), str(meta["name"])


def _pool() -> ThreadPoolExecutor:
    # Its threads run torch inline: a team of theirs would slow the engine's (runtime.intra_op).
    return ThreadPoolExecutor(thread_name_prefix=_POOL_PREFIX, initializer=serial_thread)


class FunctionSandbox:
    """One worker's second layer and the thread pool that runs its sync code (see module docstring).

    ``layer`` is None when the worker is not sandboxed (``EMBER_WORKER_SANDBOX=off``, or a
    worker started by hand): then :meth:`confine` only remembers the function.
    """

    def __init__(self, layer: FunctionLayer | None) -> None:
        self.layer = layer
        self.executor = _pool()
        self.confined_to: tuple[str, str] | None = None
        self.report: SandboxReport | None = None
        self._complete = False

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        """Make :attr:`executor` the loop's default (``asyncio.to_thread``), before anything uses it."""
        loop.set_default_executor(self.executor)

    async def confine(self, spec: dict[str, Any]) -> None:
        """Stack the layer for ``spec``'s function (once); call on the event loop's thread.

        Raises :class:`ConfinedElsewhere` for a second, different function, and
        :class:`SandboxError` when the layer cannot be stacked, an older thread survives it, or
        an earlier call did not complete (the worker is then of no use: fail closed).
        """
        wanted = function_id(spec)
        if self.confined_to is not None:
            if self.confined_to != wanted:
                raise ConfinedElsewhere(
                    f"this worker is confined to function {'/'.join(self.confined_to)}; start another"
                )
            if not self._complete:
                raise SandboxError("this worker's confinement to its function did not complete")
            return
        self.confined_to = wanted  # from here on, whatever happens, no other function
        if self.layer is not None:
            await self._stack(self.layer, self.layer.function_dir(*wanted))
        self._complete = True

    async def _stack(self, layer: FunctionLayer, own: Path) -> None:
        current = threading.current_thread()
        older = [t for t in threading.enumerate() if t is not current]
        self.report = layer.restrict(own)  # no await before this: no thread starts meanwhile
        if not self.report.applied:
            return
        old, self.executor = self.executor, _pool()
        asyncio.get_running_loop().set_default_executor(self.executor)
        await asyncio.to_thread(old.shutdown, True)  # on a new (confined) thread: joins the old ones
        if not self.report.all_threads:
            survivors = sorted(t.name for t in older if t.is_alive())
            if survivors:
                raise SandboxError(f"threads from before the function's sandbox layer still run: {survivors}")
