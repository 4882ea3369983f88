"""Canteen: an LLM inference service on streaming gRPC (shared kernel)."""

__version__ = "0.1.0"
