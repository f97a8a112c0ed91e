"""Cluster mode's Knative backend: functions as Knative Services (CLUSTER.md).

- :mod:`~scheduler.knative.render`: the Function spec -> Knative Service mapping (its table is
  the module docstring) and the token Secret;
- :mod:`~scheduler.knative.naming`: Service and Secret names from qualified ids;
- :mod:`~scheduler.knative.tokens`: per-function worker tokens (HMAC of the cluster secret);
- :mod:`~scheduler.knative.config`: settings from ``EMBER_*`` variables;
- :mod:`~scheduler.knative.backend`: the backend interface and the manifest-directory backend;
- :mod:`~scheduler.knative.kube`: the Kubernetes API backend (never run against a cluster here);
- :mod:`~scheduler.knative.status`: readiness from a Service's status;
- :mod:`~scheduler.knative.deployments`: what the gateway calls on deploy, delete, describe;
- :mod:`~scheduler.knative.targets`: invocation routes to Services' cluster-local URLs.
"""
