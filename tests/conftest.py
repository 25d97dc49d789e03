from __future__ import annotations

import pytest
import torch

from tests.helpers import make_model, make_tokenizer

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, tok_dir):
    """A random 2-layer GQA Llama (fp32) on disk: (path, hf_model)."""
    path = tmp_path_factory.mktemp("tiny")
    hf = make_model(path, tok_dir, seed=0)
    return path, hf


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory, tok_dir):
    """A different, smaller random Llama with the same tokenizer."""
    path = tmp_path_factory.mktemp("tiny_draft")
    hf = make_model(path, tok_dir, seed=1, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    return path, hf
