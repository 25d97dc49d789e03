"""Speculative decoding: proposers/ (what to guess), policy/ (how much to guess), verify/ (exact
acceptance), and the round that runs them, step.py (plan -> propose -> verify -> accept -> commit)."""
