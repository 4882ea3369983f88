"""The scheduler: continuous batching and KV-block accounting across workers (no torch)."""
