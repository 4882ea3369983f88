"""The model worker: one model version on one device, paged KV, one forward per step."""
