from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused kernels run on CPU under Triton's interpreter

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers import make_eagle3_head, make_model, make_tokenizer  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture(scope="session", autouse=True)
def session_calibration_cache(tmp_path_factory):
    """The adaptive policy's calibration cache for this run only: engines of one fingerprint share
    a measurement within the run (a warm start), and no run depends on timings an earlier one left."""
    directory = tmp_path_factory.mktemp("costs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("engine.speculative.policy.calibration.cache_dir", lambda: directory)
        yield directory


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
    hf = make_model(path, tok_dir, seed=6, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)  # seed: some proposals accepted
    return path, hf


@pytest.fixture(scope="session")
def tiny_head(tmp_path_factory, tiny_model):
    """An EAGLE-3 head for tiny_model (its 3 target layers' features: 0, 1, 1) that guesses the
    token two back (some proposals accepted), over a draft vocabulary of two ids in three."""
    import json

    path = tmp_path_factory.mktemp("eagle3")
    vocab = json.loads((tiny_model[0] / "config.json").read_text())["vocab_size"]
    make_eagle3_head(path, tiny_model[0], seed=3, aux=[0, 1, 1], draft_vocab=[i for i in range(vocab) if i % 3 != 2],
                     two_back=tiny_model[1].model.embed_tokens.weight.detach())
    return path


# One real `serve run serve_config.yaml` for the e2e and reliability suites (started on first use).
from tests.serve_fixture import server  # noqa: E402, F401


def pytest_addoption(parser):
    parser.addoption("--soak", action="store_true", default=False,
                     help="reliability soak mode: 128 clients for 10 minutes (default: 32 clients for 60 s)")
