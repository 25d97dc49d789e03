"""Exact acceptance: a batch's chains, token by token or as blocks (chain.py), and its token trees (tree.py)."""
