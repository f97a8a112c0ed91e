"""The inference engine, split like nano-vllm: request state (:mod:`sequence`), KV block
accounting (:mod:`block_manager`, pure Python), continuous-batching :mod:`scheduler`,
:mod:`model_runner` (batches, KV storage, sampling) and the :mod:`engine` facade with
``step()`` and streaming. :func:`build.build_engine` is the one place an engine is assembled.
KV blocks come from the pool on demand (Tangram's ElasticKV).
"""
