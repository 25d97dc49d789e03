"""Quantized linear layers read from the published checkpoint layouts (Qwen's FP8, compressed-tensors
float- and pack-quantized, GPTQ, AWQ): the scheme a config.json names (schemes.py), each layout's
tensors read into one form (layouts.py), and `QuantLinear`, behind which the forward does not know
the format (linear.py)."""
