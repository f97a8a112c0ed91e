"""LLM-Mesh on one device: co-located instances scheduled token by token, by headroom.

Several small models share one device (a CPU node's cores included). Instead of running
their iterations side by side (each on a slice of the cores, every barrier of every op
fighting the others), the device runs one iteration at a time on all of its cores and picks
the instance whose most urgent request has the least *headroom* (LLM-Mesh Eq. 1,
:mod:`runtime.mesh.slo`). Iteration times come from time tables interpolated over profiled
points (§5.2, :mod:`runtime.mesh.time_table`); a request joins an instance only after a
*shadow validation* simulated that nobody's SLO breaks (§5.3, :mod:`runtime.mesh.shadow`);
KV follows watermark scaling with a reservation station against out-of-memory hazards (§6,
:mod:`runtime.mesh.watermark`). The device-level policy is :mod:`runtime.mesh.token_scheduler`.
These modules are pure algorithms (no torch, no I/O): the agent and the workers drive them.
"""
