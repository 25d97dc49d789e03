"""Model code: our Llama forward, checkpoint loading and the tokenizer wrapper."""
