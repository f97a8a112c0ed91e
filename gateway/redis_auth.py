"""The external Redis's password for ``ember serve``: ``EMBER_REDIS_PASSWORD``.

Kept out of the ``--redis`` URL on the command line (where ``ps`` and the pod spec show it)
and joined into the URL in the process: the cluster manifests read it from the
``ember-redis`` Secret (``scripts/knative-secrets``). The embedded Redis makes its own
(:mod:`scheduler.redis_server`: its 0700 Unix socket alone does not keep out handler code).
"""

from __future__ import annotations

from urllib.parse import quote, urlsplit, urlunsplit

PASSWORD_ENV = "EMBER_REDIS_PASSWORD"
_MAX_PASSWORD = 512


def with_password(url: str | None, password: str | None) -> str | None:
    """``url`` with ``password`` as its credential; raises ValueError on a conflict."""
    if not password:
        return url
    if len(password) > _MAX_PASSWORD:
        raise ValueError(f"{PASSWORD_ENV} is longer than {_MAX_PASSWORD} characters")
    if url is None:
        raise ValueError(f"{PASSWORD_ENV} is set but no external Redis is (--redis or EMBER_REDIS_URL)")
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise ValueError(f"{PASSWORD_ENV} needs a redis:// or rediss:// URL with a host")
    if parts.password is not None:
        raise ValueError(f"{PASSWORD_ENV} is set and the Redis URL carries a password too")
    user = quote(parts.username, safe="") if parts.username else ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))
