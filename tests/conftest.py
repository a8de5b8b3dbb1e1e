"""Shared, expensive fixtures: the embedded model is loaded once per test session."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time

import httpx
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
    from gguf_tokenizer import build_hf_tokenizer

    return build_hf_tokenizer(gguf_path, tmp_path_factory.mktemp("smollm2-tokenizer"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(url: str, proc: subprocess.Popen, what: str, seconds: float = 60) -> None:
    """Poll `url` until it answers 200; fail early, with its exit code, if `proc` dies first."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before answering")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not come up in {seconds:.0f} s")


@contextlib.contextmanager
def running_server(args: list[str], health_url: str, what: str):
    """Run `python ARGS` until the block ends; it is up once `health_url` answers 200. Killed (by its own pid) after."""
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_up(health_url, proc, what)
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def llama_server(gguf_path):
    """llama-cpp-python's real OpenAI-compatible server on the embedded GGUF, model alias `smollm2`."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    args = ["-m", "llama_cpp.server", "--model", str(gguf_path), "--host", "127.0.0.1", "--port", str(port),
            "--n_ctx", "2048", "--verbose", "False", "--model_alias", "smollm2"]
    with running_server(args, f"{url}/models", "llama_cpp.server"):
        yield url


@pytest.fixture(scope="session")
def ray_cluster():
    """A two-node Ray cluster on this machine (tests/ray_cluster.py), one per session; needs the ray extra."""
    from ray_cluster import running_cluster

    with running_cluster() as cluster:
        yield cluster
