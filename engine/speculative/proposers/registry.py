"""Proposers by `speculative_method`: a registry from method name to factory. A proposer is added
by registering it (`register_proposer`, from any module, a test's included), with no change to
the engine; SpecConfig then accepts its name (docs/contributing.md, "Add a proposer")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.config import SPEC_METHODS, SpecConfig
from engine.kv import KVManager
from engine.model.eagle3 import Eagle3Head
from engine.model.transformer import Transformer
from engine.speculative.proposers.base import CostObserver, Proposer
from engine.speculative.proposers.draft_model import DraftModelProposer
from engine.speculative.proposers.eagle import EagleProposer
from engine.speculative.proposers.hybrid import HybridProposer
from engine.speculative.proposers.ngram import NgramProposer
from engine.speculative.proposers.suffix import MIN_MATCH, SuffixCache, SuffixProposer


@dataclass
class ProposerSources:
    """What a factory builds a proposer from: the engine's draft model or EAGLE-3 head (None where
    none was loaded), the KV manager, where passes report their times, the target's vocabulary
    and device, and the replica's suffix cache. The model proposer is built once and shared by
    every method that proposes with it: its per-request state outlives a reconfiguration."""

    draft_model: Transformer | Eagle3Head | None
    kv: KVManager
    costs: CostObserver
    vocab_size: int
    device: torch.device
    suffix_cache: SuffixCache
    _model: Proposer | None = field(default=None, repr=False)

    def model_proposer(self) -> Proposer | None:
        """The draft model's or the head's proposer (None: no draft model loaded)."""
        if self._model is None and self.draft_model is not None:
            self._model = EagleProposer(self.draft_model, self.kv, self.costs) \
                if isinstance(self.draft_model, Eagle3Head) \
                else DraftModelProposer(self.draft_model, self.kv, self.costs, self.vocab_size)
        return self._model


Factory = Callable[[SpecConfig, ProposerSources], Proposer]
_FACTORIES: dict[str, Factory] = {}


def register_proposer(method: str, factory: Factory, uses_draft_model: bool = False) -> None:
    """Makes `method` a speculative_method: factory(settings, sources) builds its proposer each
    time the settings change. uses_draft_model: it proposes with the draft model or head, which
    the engine then loads (`draft_model` must be given)."""
    if not isinstance(method, str) or not method:
        raise ValueError(f"a proposer's method name must be a non-empty string, got {method!r}")
    _FACTORIES[method] = factory
    SPEC_METHODS[method] = uses_draft_model


def build_proposer(settings: SpecConfig, sources: ProposerSources) -> Proposer:
    """The proposer settings.speculative_method names."""
    method = settings.speculative_method
    if settings.needs_draft_model and sources.model_proposer() is None:
        raise ValueError(f"speculative_method={method!r} needs a draft model (draft_model); this engine has none")
    return _FACTORIES[method](settings, sources)


def _model_of_kind(kind: str) -> Factory:
    """The draft model's proposer for "draft", the head's for "eagle"; the other is an error."""
    def factory(settings: SpecConfig, sources: ProposerSources) -> Proposer:
        model = sources.model_proposer()
        if model.name != kind:
            raise ValueError(f"speculative_method={kind!r} does not fit this engine's draft_model, "
                             f"{'an EAGLE-3 head' if model.name == 'eagle' else 'a draft model'}: use "
                             f"{model.name!r}, 'hybrid', 'ngram' or 'suffix'")
        return model
    return factory


def _lookup(settings: SpecConfig, sources: ProposerSources, suffix: bool, min_match: int | None = None) -> Proposer:
    if suffix:
        return SuffixProposer(sources.suffix_cache, settings.suffix_sharing, sources.vocab_size, sources.device,
                              min_match or MIN_MATCH)
    return NgramProposer(sources.vocab_size, sources.device, settings.ngram_max, min_match or settings.ngram_min,
                         settings.ngram_one_token_match_max)


def _hybrid(settings: SpecConfig, sources: ProposerSources) -> Proposer:
    """A lookup (prompt lookup, or suffix decoding) trusted from hybrid_ngram_min tokens, the model
    proposer for the rest."""
    lookup = _lookup(settings, sources, settings.hybrid_lookup == "suffix", settings.hybrid_ngram_min)
    return HybridProposer(lookup, sources.model_proposer())


register_proposer("draft", _model_of_kind("draft"), uses_draft_model=True)
register_proposer("eagle", _model_of_kind("eagle"), uses_draft_model=True)
register_proposer("hybrid", _hybrid, uses_draft_model=True)
register_proposer("ngram", lambda settings, sources: _lookup(settings, sources, False))
register_proposer("suffix", lambda settings, sources: _lookup(settings, sources, True))
