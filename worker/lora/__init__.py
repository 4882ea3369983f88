"""LoRA adapters on the worker: loaded on demand, several applied in one step (docs/lora.md)."""
