"""Names shared by cluster mode's pieces: the labels and annotations a rendered Knative
Service and its pods carry, the pool socket directory, and how a Kubernetes node maps to device ids.

The gateway renders them (``scheduler.knative``), Knative copies revision metadata onto each
pod, the scheduler extender reads them from the ``v1.Pod`` kube-scheduler sends it, and the
worker finds its pool by them. One module, so the writer and the readers cannot drift apart.
Label *values* are DNS labels (a function's name, its namespace); anything else (the model id,
byte counts, the qualified id with its ``/``) travels as an annotation.
"""

from __future__ import annotations

LABEL_FUNCTION = "ember.dev/function"  # the function's name (a DNS label)
LABEL_NAMESPACE = "ember.dev/namespace"  # its Ember namespace (a DNS label)
ANNOTATION_FUNCTION_ID = "ember.dev/function-id"  # its qualified id (scheduler.names)
ANNOTATION_MODEL = "ember.dev/model"  # the registered model's id (the residency map's key)
ANNOTATION_WEIGHT_BYTES = "ember.dev/weight-bytes"  # its weight bytes, decimal

POOL_DIR_ENV = "EMBER_POOL_DIR"  # where a node's pool sockets are (a read-only hostPath in pods)
DEFAULT_POOL_DIR = "/var/run/ember"
CPU_SOCKET = "cpu.sock"  # the CPU pool's socket inside the pool directory
NODE_HOME = "/var/lib/ember"  # EMBER_HOME of gateway, nodes and function pods: same model dirs
NODE_NAME_ENV = "EMBER_NODE_NAME"  # the Kubernetes node (downward API: spec.nodeName)


def device_id(node: str, device: str = "cpu") -> str:
    """The cluster state's id of ``device`` on ``node``: what pools report residency under."""
    return f"{node}/{device}"


def node_of(device_id: str) -> str:
    """The node part of a device id (``node/cpu`` -> ``node``)."""
    return device_id.rpartition("/")[0]
