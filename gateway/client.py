"""The CLI's side of the gateway API: where the gateway is, and typed calls to it.

The gateway is found from ``--url`` / ``EMBER_URL`` (with ``EMBER_API_KEY``), else from the
``serve.json`` that ``ember serve`` writes under ``EMBER_HOME``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx


class GatewayError(Exception):
    """The gateway answered with an error (its type and message) or could not be reached."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    url: str
    api_key: str | None


def find_endpoint(url: str | None, home: Path) -> Endpoint:
    """``url`` or ``EMBER_URL``, else the running ``ember serve`` recorded in ``home/serve.json``."""
    key = os.environ.get("EMBER_API_KEY") or None
    url = url or os.environ.get("EMBER_URL") or None
    if url:
        return Endpoint(url.rstrip("/"), key)
    path = home / "serve.json"
    try:
        info = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        raise GatewayError(
            f"no gateway: start `ember serve` (looked for {path}) or pass --url / EMBER_URL"
        ) from None
    return Endpoint(str(info["url"]), key or info.get("api_key"))


class GatewayClient:
    """Blocking calls to a gateway (one pooled connection)."""

    def __init__(self, endpoint: Endpoint, timeout: float = 600.0) -> None:
        headers = {"authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
        self.http = httpx.Client(base_url=endpoint.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            resp = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise GatewayError(f"cannot reach the gateway at {self.http.base_url}: {exc}") from None
        _raise_for_error(resp)
        return resp

    def stream(self, path: str, body: bytes) -> Iterator[dict[str, Any]]:
        """POST ``body`` and yield the JSON of each server-sent event until ``[DONE]``."""
        headers = {"content-type": "application/json"}
        try:
            with self.http.stream("POST", path, content=body, headers=headers) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    _raise_for_error(resp)
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line[6:] == "[DONE]":
                        return
                    event = json.loads(line[6:])
                    if isinstance(event, dict) and "error" in event and "choices" not in event:
                        raise GatewayError(f"{event['error'].get('type')}: {event['error'].get('message')}")
                    yield event
        except httpx.HTTPError as exc:
            raise GatewayError(f"the stream broke: {exc}") from None


def _raise_for_error(resp: httpx.Response) -> None:
    if resp.status_code < 400:
        return
    try:
        err = resp.json()["error"]
        message = f"{err['type']}: {err['message']}"
    except (ValueError, KeyError, TypeError):
        message = f"HTTP {resp.status_code}: {resp.text[:300]}"
    raise GatewayError(message)
