"""Shared, expensive fixtures: the embedded model is loaded once per test session."""

from __future__ import annotations

import pytest

from blackjack_rl.game import Rules
from blackjack_rl.solver import solve
from blackjack_rl.tokens import ChatFormat, LlamaCppTokenizer, embedded_model_path


@pytest.fixture(scope="session")
def solution():
    return solve(Rules())


@pytest.fixture(scope="session")
def gguf_path():
    return embedded_model_path()


@pytest.fixture(scope="session")
def vocab_chat(gguf_path) -> ChatFormat:
    """The embedded model's chat format from its vocabulary alone (how bots are tokenized)."""
    return ChatFormat.learn(LlamaCppTokenizer.from_gguf(gguf_path))


@pytest.fixture(scope="session")
def embedded():
    from blackjack_rl.policies.embedded import EmbeddedPolicy

    policy = EmbeddedPolicy(max_tokens=48, n_ctx=1024)
    yield policy
    policy._worker.shutdown(wait=True)


@pytest.fixture(scope="session")
def embedded_constrained():
    from blackjack_rl.policies.embedded import EmbeddedPolicy

    policy = EmbeddedPolicy(max_tokens=48, n_ctx=1024, constrained=True)
    yield policy
    policy._worker.shutdown(wait=True)


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory, gguf_path):
    from gguf_tokenizer import build_hf_tokenizer

    return build_hf_tokenizer(gguf_path, tmp_path_factory.mktemp("smollm2-tokenizer"))
