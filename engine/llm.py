"""LLM, the offline batch API: `LLM(**EngineConfig fields).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence

from engine.config import EngineConfig, with_embedded_defaults
from engine.engine import LLMEngine, Prompt
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    """Offline batch generation: `LLM(**EngineConfig fields).generate(prompts, params)`; with no
    model given, the embedded target with speculation on by its EAGLE-3 head (or by its draft
    model, asked for with speculative_method="draft")."""

    def __init__(self, **kwargs):
        self.config = EngineConfig.from_kwargs(**with_embedded_defaults(kwargs))
        self.engine = LLMEngine(self.config)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        ids = self._add_all(prompts, params_list)
        from tqdm import tqdm

        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                bar.update(sum(out.finished for out in self.engine.step()))
        results = [self.engine.get_output(rid) for rid in ids]
        for rid in ids:
            self.engine.release(rid)
        return results

    def _add_all(self, prompts: list[Prompt], params_list: list[SamplingParams]) -> list[str]:
        """Adds every request, or none (a bad one aborts those already added)."""
        ids: list[str] = []
        try:
            for prompt, params in zip(prompts, params_list):
                ids.append(self.engine.add_request(prompt, params))
        except ValueError:
            for rid in ids:
                self.engine.abort(rid)
                self.engine.release(rid)
            raise
        return ids
