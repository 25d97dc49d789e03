"""specserve engine: an inference engine for Llama-family models with lossless speculative decoding (no Ray)."""

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.llm import LLM
from engine.request import RequestOutput, StepOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "StepOutput"]
