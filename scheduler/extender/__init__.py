"""Residency-aware placement of function pods: a kube-scheduler extender (CLUSTER.md).

kube-scheduler's ``ember-scheduler`` profile calls the extender over HTTP for each function
pod: ``filter`` drops the nodes whose pool is down or cannot fit the pod's model,
``prioritize`` scores the rest 0..10 by Tangram's Eq. 3 (missing bytes over the node's measured
load bandwidth, plus queueing), from the residency every node's pool reports to Redis.

* :mod:`scheduler.extender.wire`: the wire types (``ExtenderArgs``, ``ExtenderFilterResult``,
  ``HostPriorityList``), decoded with bounds;
* :mod:`scheduler.extender.policies`: the decisions (pure Python) and the score mapping;
* :mod:`scheduler.extender.residency`: device reports from Redis, briefly cached;
* :mod:`scheduler.extender.service`: the two verbs over JSON documents, each decision logged.

The HTTP service is :mod:`gateway.extender` (``ember extender``, or mounted in the gateway).
"""
