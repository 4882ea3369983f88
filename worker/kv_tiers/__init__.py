"""KV tiers below the worker's pool: host memory, then disk (docs/kv-tiers.md)."""
