"""Speculative decoding: proposers, exact acceptance, adaptive K, and the speculative runner."""
