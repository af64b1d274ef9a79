"""KV cache events in vLLM's wire format: ZMQ PUB of msgpack `KVEventBatch`es with a ROUTER
replay socket (`--kv-events-config`), the block hashes they carry, and the reader of those
batches (vLLM's and ours). See docs/kv-events.md."""
