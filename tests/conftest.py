"""Shared, expensive fixtures: the embedded model is loaded once per test session."""

from __future__ import annotations

import os

import pytest
from helpers import build_hf_tokenizer, free_port, running_server

from blackjack_rl.game.table import Rules
from blackjack_rl.game.solver import solve
from blackjack_rl.contract.tokens import ChatFormat, LlamaCppTokenizer, embedded_model_path


# Apps made in this process check posts in threads: a worker process costs each of the many
# short-lived test apps ~0.5 s to start. Servers run as subprocesses (helpers.ServerProcess)
# keep the default, one worker on 2+ cores, and tests of the workers ask for them.
os.environ.setdefault("BLACKJACK_RL_API_INGEST_WORKERS", "0")

# Under pytest-xdist each worker gets its share of the cores for torch's (OpenMP) threads, here and
# in the commands it starts: with every worker's torch on every core, their threads spin against
# each other. llama.cpp measures its free
# cores itself (blackjack_rl.threads). Set before any test module imports torch.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _share)))


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
    from blackjack_rl.policies.sampling import Sampling

    policy = EmbeddedPolicy(sampling=Sampling(max_tokens=48), n_ctx=1024)
    yield policy
    policy._worker.shutdown(wait=True)


@pytest.fixture(scope="session")
def embedded_constrained():
    from blackjack_rl.policies.embedded import EmbeddedPolicy
    from blackjack_rl.policies.sampling import Sampling

    policy = EmbeddedPolicy(sampling=Sampling(max_tokens=48), n_ctx=1024, constrained=True)
    yield policy
    policy._worker.shutdown(wait=True)


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory, gguf_path):
    return build_hf_tokenizer(gguf_path, tmp_path_factory.mktemp("smollm2-tokenizer"))


@pytest.fixture(scope="session")
def llama_server(gguf_path):
    """llama-cpp-python's real OpenAI-compatible server on the embedded GGUF, model alias `smollm2`."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    args = ["-m", "blackjack_rl.policies.llama_server", "--model", str(gguf_path), "--host", "127.0.0.1", "--port", str(port),
            "--n_ctx", "2048", "--verbose", "False", "--model_alias", "smollm2"]
    with running_server(args, f"{url}/models", "llama_cpp.server"):
        yield url


@pytest.fixture(scope="session")
def ray_cluster():
    """A two-node Ray cluster on this machine (tests/ray_cluster.py), one per session; needs the ray extra."""
    from ray_cluster import running_cluster

    with running_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, gguf_path):
    """A 2-layer llama with random weights and SmolLM2's vocabulary, large enough at init that its
    logits differ: the trainer's tests train it in seconds (needs the train extra)."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    from blackjack_rl.model.io import build_hf_tokenizer as save_tokenizer

    out = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1,
        pad_token_id=2, initializer_range=0.3,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    save_tokenizer(gguf_path, out)
    return out
