"""kvsim: record, replay, simulate and validate KV-cache policies for long-form speech LLMs."""

__version__ = "0.1.0"
