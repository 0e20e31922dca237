"""Tandem's engine: one model on one device with continuous batching and a paged,
prefix-caching KV cache. Each backend actor owns exactly one `LLMEngine`."""
