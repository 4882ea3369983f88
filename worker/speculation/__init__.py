"""Speculative decoding: drafts proposed by n-gram lookup or a draft model."""
