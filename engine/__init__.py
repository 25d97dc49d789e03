"""specserve engine: an inference engine for Llama-family models with lossless speculative decoding (no Ray)."""

from engine.config import EngineConfig, SamplingParams
from engine.engine import LLM, LLMEngine
from engine.request import RequestOutput, StepOutput

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "StepOutput"]
