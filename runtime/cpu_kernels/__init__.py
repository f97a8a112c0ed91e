"""Ember's CPU decode kernels: the C extension ``runtime._cpu_kernels`` and its typed wrapper.

Batch decode on a CPU is memory-bound: every token streams all weights once, so the step must
read them at memory bandwidth with almost no per-op overhead (eager PyTorch pays 5-10 us per
dispatcher op, ~35 ops per layer, and gathers each sequence's KV context every layer). The
extension (C, CPython API only, OpenMP through the libgomp torch already loaded) provides
``linear`` over bf16, fp32, q8_0 and q4_1 weights for 1..64 rows per weight tile (fused
q/k/v and gate/up with the SwiGLU epilogue, optional residual accumulate), ``rms_norm``,
``rope``, ``kv_write`` into the paged cache and ``paged_decode_attention`` reading K/V in place
through block tables with an online softmax; an AVX-512 path (with bf16 dot products) or else
an AVX2/FMA path is chosen at import, a portable path runs everywhere else.
:mod:`runtime.cpu_kernels.ops` loads it (``EMBER_CPU_KERNELS``: ``auto``, ``avx512``, ``avx2``,
``generic`` or ``off``) and wraps every kernel over tensors;
:mod:`runtime.models.llama_decode` drives a whole Llama step through it.
"""
