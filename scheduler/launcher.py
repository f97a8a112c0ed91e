"""What the scheduler needs from whatever starts instances (the node agent in embedded mode).

A structural interface: ``runtime.agent.NodeAgent`` satisfies it without importing the
scheduler, which keeps the dependency direction ``gateway -> scheduler`` and
``gateway -> runtime`` (DESIGN.md). A cluster-mode launcher (Knative) fits the same calls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

# The ``code`` of the exception a launch raises when the device's pool had no room for the
# model next to what others pin (the scheduler places again instead of failing the function).
NO_ROOM = "no_room"
# The ``code`` of the exception a launch raises when its worker served the instance's first
# requests, then exited before the activation's reply: the instance died, the function did not
# fail to start (the waiting requests start another).
INSTANCE_LOST = "instance_lost"
# The error ``code`` of a worker's answer to a request sent to it before its activation ended
# (see BaseLauncher.launch's ``on_target``) when that activation failed: the request never ran.
NOT_STARTED = "not_started"
# The request header that names the instance such a request is for, and the response header
# (naming it too) of that 503: only the worker's hold sets it, no handler's error can.
INSTANCE_HEADER = "x-ember-instance-id"
NEVER_RAN_HEADER = "x-ember-never-ran"
# The most requests sent to an instance before it is ready (the others wait for ready); its
# worker holds more (runtime.early_requests.MAX_HELD), for requests whose clients hung up.
MAX_EARLY = 64

# (url, credential) of the process a launch is activating: see BaseLauncher.launch.
OnTarget = Callable[[str, str], None]


class StartedInstance(Protocol):
    """What starting one instance measured."""

    @property
    def url(self) -> str: ...
    @property
    def pid(self) -> int: ...
    @property
    def bytes_loaded(self) -> int: ...
    @property
    def bytes_reused(self) -> int: ...
    @property
    def timings_ms(self) -> Mapping[str, float]: ...
    @property
    def log_path(self) -> str: ...
    @property
    def token(self) -> str:
        """The instance's credential: requests to ``url`` must carry it."""
        ...


class BaseLauncher(Protocol):
    """Starts and stops instances on the devices it owns and reports those devices."""

    def devices(self) -> list[str]:
        """Ids of the devices this launcher starts instances on (``node/cpu``)."""
        ...

    async def launch(
        self,
        instance_id: str,
        spec: dict[str, Any],
        model: dict[str, Any],
        device_id: str,
        deadline: float,
        on_target: OnTarget | None = None,
    ) -> StartedInstance:
        """Start ``instance_id`` of the function ``spec`` with ``model`` on ``device_id``; a
        failure for lack of room in the device's pool raises an exception whose ``code`` is
        :data:`NO_ROOM`. ``on_target(url, token)``, when given, is told the process the
        instance is being activated in before the activation ends (again if another process is
        tried): a request sent there with :data:`INSTANCE_HEADER` is held until the activation
        ends, then served, or answered 503 :data:`NOT_STARTED` with :data:`NEVER_RAN_HEADER`
        (it never ran) if it failed."""
        ...

    async def stop(self, instance_id: str, standby: bool = False) -> None:
        """Drain and stop an instance (a no-op for one it does not run). ``standby``: it idled
        past its keep-alive, and the launcher may prepare its function's next start ahead of
        time (the node agent's standby workers); false when it was retired or lost."""
        ...

    async def retire(self, name: str) -> None:
        """``name`` was deleted or redeployed: drop what the launcher prepared for its next start
        (the node agent's standby)."""
        ...

    def alive(self, instance_id: str) -> bool:
        """Whether the instance's process still runs."""
        ...

    def owns(self, instance_id: str) -> bool:
        """Whether this launcher runs the instance (its liveness is this launcher's to judge)."""
        ...

    async def report(self) -> dict[str, dict[str, Any]]:
        """Publish the devices' pool stats to the cluster state; returns them by device id."""
        ...
