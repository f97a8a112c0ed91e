"""Typed errors of the scheduler and cluster state."""

from __future__ import annotations


class SchedulerError(Exception):
    code = "scheduler_error"


class StateUnavailable(SchedulerError):
    """Redis cannot be reached or started."""

    code = "state_unavailable"


class FunctionNotFound(SchedulerError, KeyError):
    code = "function_not_found"

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "function not found"


class StateConflict(SchedulerError):
    """A state transition lost a race (the instance is not in the expected state)."""

    code = "state_conflict"


class FunctionQuotaExceeded(SchedulerError):
    """A deploy of a new function into a namespace that already holds its cap of functions."""

    code = "function_quota_exceeded"


class WarmQuotaExceeded(FunctionQuotaExceeded):
    """A deploy whose ``minScale`` would take its namespace's always-on instances (the sum of
    its functions' ``minScale``) past the namespace's quota: instances kept up without any
    request are capacity a tenant reserves, so they are bounded like its functions."""

    code = "min_scale_quota_exceeded"


class StateNotWritable(SchedulerError):
    """Redis is up but refuses writes (HTTP 503 with Retry-After): the state store cannot write."""

    code = "state_not_writable"


class StateOutOfMemory(StateNotWritable):
    """Redis reached ``maxmemory`` and evicts nothing (its ``OOM`` error)."""

    code = "state_out_of_memory"


class StatePersistenceFailed(StateNotWritable):
    """Redis cannot persist (its ``MISCONF`` error: a failed background save, a full disk)."""

    code = "state_persistence_failed"


class StoredNotDurable(StateNotWritable):
    """A change was stored but Redis did not confirm it on disk (a slow or full disk, a failed
    fsync): it may not survive a Redis crash. The operation's other effects still happened;
    the client is told (503) and may repeat it: deploys are idempotent."""

    code = "state_not_durable"


class Rejected(SchedulerError):
    """The request cannot start before its deadline (HTTP 503 with Retry-After)."""

    code = "rejected"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StartFailed(SchedulerError):
    """The function's instance failed to start; the message says why."""

    code = "instance_start_failed"
