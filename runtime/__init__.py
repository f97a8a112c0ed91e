"""What runs inside a function instance: the worker process, the pre-warmed process pool,
the handler SDK, the inference engine, model loaders and tokenizers. Workers get their
weights and KV blocks from ``gpu_pool.client``. Today it holds model registration
(:mod:`runtime.registry`: GGUF, safetensors and ``pkg:`` sources into the model store);
the engine and workers are built by the inference-engine and serving issues.
:mod:`runtime.supervisor` restarts dead children (pool daemons, the embedded redis-server)
with exponential backoff.

The node agent (:mod:`runtime.agent`) is made of :mod:`runtime.device_pools` (the pool
daemons and their supervision), :mod:`runtime.warm_pool` (the pre-warmed workers),
:mod:`runtime.standby_pool` (workers prepared for functions that scaled to zero; the worker
side is :mod:`runtime.assignment`; requests sent ahead of an activation wait in
:mod:`runtime.early_requests`), :mod:`runtime.survivors` (workers whose instances ended with
their pool daemon, assigned their function again once it is back; the worker side is
:mod:`runtime.worker_state`),
:mod:`runtime.worker_handle` (one worker as the agent sees it), :mod:`runtime.worker_client`
(its HTTP client for the workers), :mod:`runtime.device_report`
(the scheduler's device record) and :mod:`runtime.agent_config`. It talks to workers in
:mod:`runtime.messages`; the assign reply carries ``gpu_pool``'s ``AcquireReport``.
:mod:`runtime.sandbox` confines each worker the agent starts with
Landlock, so handler code cannot read ``EMBER_HOME`` beyond ``models/``, ``functions/``
and ``tmp/`` (no ``serve.json``, Redis files or logs), write it beyond ``tmp/``, or signal
processes outside the worker; once assigned (:mod:`runtime.function_sandbox`) it reads only its
own function's code there. :mod:`runtime.worker_limits` sets each worker's resource limits and
drops its capabilities; :mod:`runtime.landlock` is the kernel interface.
"""
