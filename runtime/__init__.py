"""What runs inside a function instance: the worker process, the pre-warmed process pool,
the handler SDK, the inference engine, model loaders and tokenizers. Workers get their
weights and KV blocks from ``gpu_pool.client``. Built by the inference-engine and serving
issues on top of the pool.
"""
