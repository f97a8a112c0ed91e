"""Functions as Knative Services: what the gateway calls on deploy, delete, describe and list.

:meth:`KnativeDeployments.check` renders a function (a :class:`scheduler.spec.SpecError` for
a spec Knative cannot express) before anything is stored; :meth:`~KnativeDeployments.apply`
renders it again from the stored record, derives its worker token and hands both objects to
the backend (with a custom handler's code, read by ``read_code``: the gateway reads the module it
stored); :meth:`~KnativeDeployments.remove` deletes them; :meth:`~KnativeDeployments.status`
is the ``status.knative`` block ``describe`` shows. The calls block (the Kubernetes client is
synchronous): the gateway runs them in threads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from scheduler.knative.backend import BaseServiceBackend
from scheduler.knative.config import KnativeConfig
from scheduler.knative.errors import KnativeError
from scheduler.knative.handler_code import HandlerCode
from scheduler.knative.naming import service_name
from scheduler.knative.render import Rendered, render_record
from scheduler.knative.status import ServiceStatus
from scheduler.knative.tokens import WorkerTokens
from scheduler.records import FunctionRecord
from scheduler.spec import SpecError

log = logging.getLogger("ember.knative")

# A stored function's custom handler module (SpecError when it cannot be read).
CodeReader = Callable[[FunctionRecord], HandlerCode]


def _handler(record: FunctionRecord) -> str:
    body = record.spec.get("spec")
    handler = body.get("handler", "default") if isinstance(body, dict) else "default"
    return handler if isinstance(handler, str) else "default"


def _no_code(record: FunctionRecord) -> HandlerCode:
    raise SpecError(f"spec.handler: {_handler(record)[:200]!r}: this gateway stores no handler modules")


class KnativeDeployments:
    """See the module docstring."""

    def __init__(
        self,
        config: KnativeConfig,
        tokens: WorkerTokens,
        backend: BaseServiceBackend,
        read_code: CodeReader = _no_code,
    ) -> None:
        self.config = config
        self.tokens = tokens
        self.backend = backend
        self.read_code = read_code

    def check(self, record: FunctionRecord) -> Rendered:
        """The function's objects; :class:`SpecError` if Knative cannot express its spec. A
        custom handler's module is not read: it is checked where it is stored."""
        handler = _handler(record)
        code = None if handler == "default" else HandlerCode.stand_in(handler)
        return render_record(record, self.config, code)

    def apply(self, record: FunctionRecord) -> Rendered:
        """Create or update the function's handler ConfigMap, token Secret and Knative Service."""
        code = None if _handler(record) == "default" else self.read_code(record)
        rendered = render_record(record, self.config, code)
        for note in rendered.notes:
            log.info("%s: %s", record.function_id, note)
        secret = rendered.secret_with(self.tokens.token(record.function_id))
        self.backend.apply(record.function_id, rendered.service, secret, rendered.config_map)
        return rendered

    def remove(self, function_id: str) -> bool:
        """Delete the function's Service, Secret and ConfigMaps (whether they were there). A function whose
        name has no Service name (deployed before cluster mode) has nothing to delete."""
        try:
            service = service_name(function_id)
        except SpecError:
            return False
        return self.backend.delete(function_id, service)

    def status(self, function_id: str) -> dict[str, Any]:
        """The ``status.knative`` block of one function (never raises: an API that cannot be
        asked is reported as such)."""
        return self.statuses([function_id])[function_id]

    def statuses(self, function_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """:meth:`status` of several functions, by qualified id, with one backend call."""
        services: dict[str, str] = {}
        out: dict[str, dict[str, Any]] = {}
        for function_id in function_ids:
            try:
                services[function_id] = service_name(function_id)
            except SpecError as exc:
                out[function_id] = ServiceStatus.unknown(
                    "", self.config.namespace, "NotRenderable", str(exc), found=None
                ).to_document()
        try:
            found = self.backend.statuses(sorted(set(services.values())))
        except KnativeError as exc:
            for function_id, service in services.items():
                out[function_id] = ServiceStatus.unknown(
                    service, self.config.namespace, "StatusUnavailable", str(exc), found=None
                ).to_document()
            return out
        for function_id, service in services.items():
            out[function_id] = found[service].to_document()
        return out

    def close(self) -> None:
        self.backend.close()
