"""One ``/_ember/assign`` from the node agent to a worker, its failures typed.

It goes over the worker's control line (:mod:`runtime.control_line`) when it has one, else
over HTTP; the reply and its failures are the same either way.

The worker that fails an assign is ended, whatever the failure: a half-assigned worker is
trusted with nothing. The caller learns why from the error's class: :class:`Undelivered` (the
connection failed before anything reached the worker: another worker may take the function),
:class:`InitFailed` (the function's own initializer failed: it would fail on any worker),
:class:`~runtime.errors.NoRoom` (the pool has no room for it),
:class:`~runtime.errors.InstanceLost` (it took the function and served the instance's first
requests, then exited before its reply) or a plain :class:`~runtime.errors.LaunchError`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from gpu_pool.errors import OutOfMemory
from runtime.control_line import ExitedServing, LineTooSmall, fits
from runtime.errors import InstanceLost, LaunchError, NoRoom
from runtime.messages import AssignMessage, AssignReply, MessageError
from runtime.worker_client import WorkerCallFailed, WorkerClient, WorkerUnreachable
from runtime.worker_handle import WorkerHandle

FUNCTION_INIT_FAILED = "function_init_failed"  # runtime.worker's error type for a failed initializer
# (url, credential) of a worker an assign goes to (scheduler.launcher.OnTarget, structurally).
OnTarget = Callable[[str, str], None]


class Undelivered(LaunchError):
    """The worker's connection failed before the assign reached it (it was ended)."""


class InitFailed(LaunchError):
    """The function's initializer failed in the worker (a function error, not the worker's)."""


async def assign(
    http: WorkerClient,
    worker: WorkerHandle,
    message: AssignMessage,
    drain_s: float,
    on_target: OnTarget | None = None,
) -> AssignReply:
    """``/_ember/assign`` ``message`` to ``worker``; a worker that fails it is ended (within
    ``drain_s``). ``on_target`` is told the worker as the assign goes out."""
    if on_target is not None:  # the worker holds what comes before the assign (either order)
        on_target(worker.url, worker.token)
    body = message.to_json()
    try:
        resp = None
        data = body.encode()
        if worker.control is not None and fits(data):  # no HTTP on the start's path
            with contextlib.suppress(LineTooSmall):  # (nothing delivered)
                resp = await worker.control.assign(data, http.timeout_s)
        if resp is None:
            resp = await http.post(worker, "assign", body)
    except WorkerUnreachable as exc:
        await worker.terminate(drain_s)
        raise Undelivered(str(exc)) from None
    except ExitedServing as exc:  # it took the function and served: the instance died
        await worker.terminate(drain_s)
        raise InstanceLost(f"worker {worker.pid} exited while its instance served: {exc}") from None
    except WorkerCallFailed as exc:
        await worker.terminate(drain_s)
        raise LaunchError(f"worker {worker.pid} did not take the function: {exc}") from None
    except BaseException:  # cancelled (the scheduler closing): a worker half assigned, ended
        await worker.terminate(drain_s)
        raise
    if resp.status != 200:
        await worker.terminate(drain_s)
        kinds = {FUNCTION_INIT_FAILED: InitFailed, OutOfMemory.code: NoRoom, InstanceLost.code: InstanceLost}
        kind = kinds.get(resp.error_type() or "", LaunchError)
        raise kind(f"worker refused the function: {resp.error_message()}")
    try:
        return AssignReply.from_json(resp.content)
    except MessageError as exc:
        await worker.terminate(drain_s)
        raise LaunchError(f"worker {worker.pid} sent a malformed assign reply: {exc}") from None
