"""Model code: the decoder-only forward over the KV pools for the registered families (families.py:
Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE), a layer's MLP (mlp.py, experts.py), attention (attention.py,
paged_attention.py), checkpoints (loader.py, quantized ones through quant/), the plan of kernels
per host (plan.py) and the kernels themselves (kernels/), each behind a load-time check."""
