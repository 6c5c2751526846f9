"""The lossless tier's two halves: :class:`~kvzip_vllm.tier.scheduler.KvzipScheduler` (in
vLLM's scheduler) and :class:`~kvzip_vllm.tier.worker.KvzipWorker` (in the model worker), which
talk only through :mod:`kvzip_vllm.tier.metadata`. ``kvzip_vllm.connector.KvzipConnector`` is
the thin vLLM connector that holds one of them, by role."""
