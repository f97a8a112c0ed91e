"""Worker credentials in cluster mode: one per function, derived, never stored in Redis.

In embedded mode the node agent gives each worker a random credential over its stdin. A
Knative pod is started by Kubernetes, not by Ember, so its credential comes from a Secret
(``<service>-worker-token``, key ``token``) that the gateway writes when it deploys the
function, and the gateway must know it again for every request without storing it: it is
``HMAC-SHA256(cluster secret, qualified id)`` in hex, the cluster secret being
``EMBER_CLUSTER_SECRET`` (gateway side only; workers see only their own function's token).
Each function's pods thus get a credential that opens no other function's pods, and
rotating the cluster secret (then redeploying) rotates every token.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

SECRET_ENV = "EMBER_CLUSTER_SECRET"
MIN_SECRET = 32  # characters: at least 192 bits when generated as `openssl rand -base64 32`
MAX_SECRET = 4096


class ClusterSecretError(ValueError):
    """``EMBER_CLUSTER_SECRET`` is missing or malformed."""


def worker_token(cluster_secret: bytes, function_id: str) -> str:
    """The credential of ``function_id``'s workers: HMAC-SHA256 of its qualified id, in hex."""
    return hmac.new(cluster_secret, function_id.encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class WorkerTokens:
    """Derives function tokens from the cluster secret (kept out of ``repr``)."""

    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not MIN_SECRET <= len(self.secret) <= MAX_SECRET:
            raise ClusterSecretError(f"{SECRET_ENV} must be {MIN_SECRET}..{MAX_SECRET} characters")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkerTokens:
        env = os.environ if environ is None else environ
        raw = env.get(SECRET_ENV)
        if not raw:
            raise ClusterSecretError(
                f"{SECRET_ENV} is not set: cluster mode derives each function's worker credential from it"
            )
        return cls(raw.encode())

    def token(self, function_id: str) -> str:
        return worker_token(self.secret, function_id)
