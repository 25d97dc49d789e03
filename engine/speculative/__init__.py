"""Speculative decoding: proposers, exact acceptance, the adaptive policy and the step pipeline."""
