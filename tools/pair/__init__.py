"""Recipe that trains the embedded default model pair (see tools/make_default_pair.py)."""
