"""The Kubernetes names of a function's objects, derived from its qualified id.

A function ``NAME`` in Ember's ``default`` namespace becomes the Knative Service ``NAME``;
``NAME`` in namespace ``NS`` becomes ``NS--NAME``. Every function's Service lives in one
Kubernetes namespace (``EMBER_KNATIVE_NAMESPACE``), so Ember namespaces are folded into the
name; ``--`` is reserved as the fold's separator (a name or namespace containing it could
collide: ``a--b`` in ``default`` and ``b`` in ``a``) and rejected. The Service name must be a
DNS-1035 label (it names the cluster-local Kubernetes Service; it starts with a letter) and
leave room for Knative's revision suffix: revisions are ``<service>-00001``, ``-00002``, ...,
and a name beyond 63 characters would be hashed by Knative into something unrecognisable
(``kubectl get revisions`` and the pods would not show the function's name). A function whose
name cannot satisfy this fails with a :class:`scheduler.spec.SpecError` naming the field.
"""

from __future__ import annotations

import re

from scheduler import names
from scheduler.spec import SpecError

SEPARATOR = "--"  # between an Ember namespace and a function name
REVISION_SUFFIX = len("-00001")  # Knative's revision name: <service>-<5-digit generation>
MAX_SERVICE_NAME = names.MAX_LABEL - REVISION_SUFFIX  # 57
TOKEN_SECRET_SUFFIX = "-worker-token"
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def service_name(function_id: str) -> str:
    """The Knative Service of the function ``function_id`` (see the module docstring)."""
    namespace, name = names.split(function_id)
    for field, label in (("metadata.namespace", namespace), ("metadata.name", name)):
        if SEPARATOR in label:
            raise SpecError(
                f"{field}: {label!r} contains '{SEPARATOR}', which cluster mode reserves to join an "
                f"Ember namespace and a function name into a Knative Service name"
            )
    service = name if namespace == names.DEFAULT_NAMESPACE else f"{namespace}{SEPARATOR}{name}"
    if not _DNS_1035.match(service):
        raise SpecError(
            f"metadata.name: the Knative Service name {service!r} must start with a letter "
            f"(a DNS-1035 label: Kubernetes Services are named by it)"
        )
    if len(service) > MAX_SERVICE_NAME:
        what = "name" if namespace == names.DEFAULT_NAMESPACE else "namespace + '--' + name"
        raise SpecError(
            f"metadata.name: the Knative Service name {service!r} ({what}) has {len(service)} characters; "
            f"at most {MAX_SERVICE_NAME} leave room for Knative's revision suffix ('-00001') in a "
            f"63-character name"
        )
    return service


def token_secret_name(service: str) -> str:
    """The Secret holding the worker credential of ``service``'s pods (key ``token``)."""
    return f"{service}{TOKEN_SECRET_SUFFIX}"
