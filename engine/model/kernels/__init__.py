"""Hand-written CPU kernels, compiled on first use (see one_sequence.py)."""
