"""Model code: the decoder-only transformer (Llama, Mistral, Qwen2, Qwen3), checkpoint loading, RoPE and the tokenizer wrapper."""
