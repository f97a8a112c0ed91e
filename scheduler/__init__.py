"""Placement and scaling decisions (Tangram affinity scheduling, Eq. 3) over cluster state kept
in Redis: nodes, devices, pool residency, functions and instances. Nothing here is written
yet beyond this package; the serving issue builds it on the pool's ``stats`` residency.
"""
