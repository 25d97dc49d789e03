"""Proposers behind one interface (base.py), found by method name (registry.py): prompt lookup, suffix
decoding, a draft model, an EAGLE-3 head, and a lookup with a model (hybrid); the drafting loops
the model proposers share (drafting.py, tree_drafting.py)."""
