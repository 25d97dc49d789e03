"""Stage 2: byte-level BPE tokenizer trained on the train split, saved in HF format."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
from tqdm import tqdm

log = logging.getLogger("recipe.tokenizer")

VOCAB_SIZE = 8192
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '# ' + message['role'] + ':\\n' + message['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '# assistant:\\n' }}{% endif %}"
)


def _iter_texts(path: Path):
    with open(path) as fh:
        for line in fh:
            yield json.loads(line)["text"]


def train_tokenizer(work: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    out = work / "tokenizer"
    if (out / "tokenizer.json").exists():
        log.info("tokenizer already trained: %s", out)
        return PreTrainedTokenizerFast.from_pretrained(out)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(_iter_texts(work / "corpus" / "train.jsonl"), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        clean_up_tokenization_spaces=False, model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    log.info("tokenizer saved to %s (vocab %d)", out, len(fast))
    return fast


def encode_splits(work: Path, tokenizer) -> dict[str, int]:
    """Token streams as uint16 arrays: BOS + file tokens + EOS per file, files concatenated."""
    counts: dict[str, int] = {}
    for split in ("train", "val"):
        path = work / "tokens" / f"{split}.u16"
        if path.exists():
            counts[split] = path.stat().st_size // 2
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        chunks: list[np.ndarray] = []
        texts = list(_iter_texts(work / "corpus" / f"{split}.jsonl"))
        for start in tqdm(range(0, len(texts), 256), desc=f"encode {split}", unit="x256 files"):
            batch = tokenizer(texts[start:start + 256], add_special_tokens=True)["input_ids"]
            for ids in batch:
                chunks.append(np.asarray(ids + [tokenizer.eos_token_id], dtype=np.uint16))
        stream = np.concatenate(chunks)
        stream.tofile(path)
        counts[split] = int(stream.size)
    log.info("token counts: %s", counts)
    return counts
