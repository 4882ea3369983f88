"""Attention over the paged KV pool: the step's batch layout and the attention paths."""
