def register() -> None:
    """vLLM general plugin entry point (filled in by the kvzip-vllm work)."""
