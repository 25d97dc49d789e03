"""The hand-written kernels: C for the CPU, compiled on first use (one_sequence.py loads them), and
Triton for CUDA (fused.py, quant.py, moe.py), each declaring the compute capabilities it needs."""
