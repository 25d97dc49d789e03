"""Which proposer a speculation setting names, built from the engine's model proposer (if any)
and the replica's suffix cache."""

from __future__ import annotations

from engine.config import SpecConfig
from engine.speculative.hybrid import HybridProposer
from engine.speculative.ngram import NgramProposer
from engine.speculative.proposer import Proposer
from engine.speculative.suffix import MIN_MATCH, SuffixCache, SuffixProposer


def build_proposer(settings: SpecConfig, draft: Proposer | None, vocab_size: int, device,
                   suffix_cache: SuffixCache) -> Proposer:
    """The proposer `settings.speculative_method` names; `draft` is the engine's model proposer
    (a draft model's or an EAGLE-3 head's), which "draft", "eagle" and "hybrid" need; suffix
    decoding reads and fills `suffix_cache` (the replica's, kept across reconfigurations)."""
    method = settings.speculative_method
    if settings.needs_draft_model and draft is None:
        raise ValueError(f"speculative_method={method!r} needs a draft model (draft_model); this engine has none")
    if method in ("draft", "eagle") and draft.name != method:
        raise ValueError(f"speculative_method={method!r} does not fit this engine's draft_model, "
                         f"{'an EAGLE-3 head' if draft.name == 'eagle' else 'a draft model'}: use "
                         f"{draft.name!r}, 'hybrid', 'ngram' or 'suffix'")
    if method in ("draft", "eagle"):
        return draft
    hybrid = method == "hybrid"
    if method == "suffix" or (hybrid and settings.hybrid_lookup == "suffix"):
        lookup = SuffixProposer(suffix_cache, settings.suffix_sharing, vocab_size, device,
                                settings.hybrid_ngram_min if hybrid else MIN_MATCH)
    else:
        lookup = NgramProposer(vocab_size, device, settings.ngram_max,
                               settings.hybrid_ngram_min if hybrid else settings.ngram_min,
                               settings.ngram_one_token_match_max)
    return HybridProposer(lookup, draft) if hybrid else lookup


def lookup_of(proposer: Proposer) -> Proposer:
    """The model-free proposer inside (hybrid's lookup), or the proposer itself."""
    return proposer.lookup if isinstance(proposer, HybridProposer) else proposer
