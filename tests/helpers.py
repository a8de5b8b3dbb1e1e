"""What many test files need: free ports, our commands in subprocesses, bounded polling, the test tokenizer.

Every wait here counts attempts instead of reading a clock: on a busy or slow machine a test
takes longer, but it neither passes nor fails because of the time it took. Every process a
test starts is stopped by its own PID, never by name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx

SRC = Path(__file__).resolve().parents[1] / "src"
CLI = [sys.executable, "-m", "blackjack_rl.cli"]
T = TypeVar("T")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """`environ` (default: this process's) with this checkout's src/ first on PYTHONPATH, so a
    subprocess runs the code under test even where another copy is installed."""
    env = dict(os.environ if environ is None else environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    return env


def run_cli(*args: str, check: bool = False, cwd: Path | None = None, timeout: float = 300,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`blackjack-rl ARGS` in a subprocess, run to its end, output captured; `check`: fail on a non-zero exit."""
    proc = subprocess.run([*CLI, *args], cwd=cwd, env=cli_env(env), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def popen_cli(*args: str, **popen: object) -> subprocess.Popen[str]:
    """`blackjack-rl ARGS` started in a subprocess; stdout and stderr together in `.stdout`."""
    return subprocess.Popen([*CLI, *args], env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **popen)  # type: ignore[call-overload]


def poll_until(condition: Callable[[], T], *, attempts: int, interval_s: float = 0.1, what: str) -> T:
    """Ask `condition` up to `attempts` times, `interval_s` apart, and return its first truthy answer.

    Fails with `what` when every attempt said no: the bound is a count of tries, so a slow
    machine gets as many chances as a fast one.
    """
    for attempt in range(attempts):
        answer = condition()
        if answer:
            return answer
        if attempt < attempts - 1:
            time.sleep(interval_s)
    raise AssertionError(f"{what}: not seen in {attempts} attempts")


def wait_until_up(url: str, proc: subprocess.Popen, what: str, *, headers: dict[str, str] | None = None,
                  attempts: int = 1200, interval_s: float = 0.1) -> None:
    """Poll `url` until it answers 200; fail at once, with its exit code, if `proc` ends first."""

    def answered() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before answering")
        try:
            return httpx.get(url, headers=headers, timeout=1.0).status_code == 200
        except httpx.TransportError:
            return False

    poll_until(answered, attempts=attempts, interval_s=interval_s, what=f"{what} answering {url}")


def kill_process(proc: subprocess.Popen | None) -> None:
    """SIGKILL `proc` by its PID if it still runs (no shutdown handlers run), and reap it."""
    if proc is not None and proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    if proc is not None:
        proc.wait(timeout=30)


def stop_process(proc: subprocess.Popen, *, timeout: float = 90) -> str:
    """SIGTERM `proc` (it drains and exits) and return its captured output."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=timeout)
    return out or ""


@contextlib.contextmanager
def running_server(args: list[str], health_url: str, what: str) -> Iterator[subprocess.Popen]:
    """`python ARGS` until the block ends; it is up once `health_url` answers 200. Killed by its PID after."""
    proc = subprocess.Popen([sys.executable, *args], env=cli_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_until_up(health_url, proc, what)
        yield proc
    finally:
        kill_process(proc)


class ServerProcess:
    """`python -m blackjack_rl.api` in a subprocess, killable with SIGKILL by PID."""

    def __init__(self, db: Path, *, port: int | None = None, args: list[str] | None = None,
                 env: dict[str, str] | None = None, token: str | None = None) -> None:
        self.db = db
        self.port = port or free_port()
        self.args = args or []
        self.extra_env = env or {}
        self.token = token
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = db.with_suffix(f".{self.port}.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "blackjack_rl.api", "--port", str(self.port), "--db", str(self.db),
                "--log-level", "warning", *self.args]

    def start(self) -> ServerProcess:
        env = cli_env()
        env.pop("BLACKJACK_RL_API_TOKEN", None)
        env.pop("BLACKJACK_RL_API_INGEST_WORKERS", None)  # the server's own default (conftest.py)
        env.update(self.extra_env)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.command(), env=env, stdout=log, stderr=subprocess.STDOUT)
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        try:
            wait_until_up(f"{self.url}/status", self.proc, "the API", headers=headers)
        except (RuntimeError, AssertionError) as e:
            self.kill()
            raise RuntimeError(f"{e}: {self.log.read_text()[-2000:]}") from None
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown handlers, no flush; only what SQLite committed survives."""
        kill_process(self.proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


class RunApiProcess(ServerProcess):
    """Atropos' own trajectory API (`run-api` of atroposlib 0.4.0), on 127.0.0.1, killable by PID.

    It keeps everything in memory; `db` only names its log file.
    """

    def command(self) -> list[str]:
        return [sys.executable, "-m", "atroposlib.cli.run_api", "--host", "127.0.0.1", "--port", str(self.port)]


def build_hf_tokenizer(gguf_path: Path, out_dir: Path) -> Path:
    """A Hugging Face tokenizer folder rebuilt from a GGUF's own vocabulary, without torch or a hub.

    Hub downloads are impossible in CI, and `AutoTokenizer.from_pretrained(gguf_file=...)`
    imports torch (as does the trainer's own builder in `blackjack_rl.train.model`); this
    rebuilds SmolLM2's byte-level BPE from the GGUF metadata with the `tokenizers` library so
    the server path (`HFTokenizer`) can be tested on the embedded model. Tests check it yields
    exactly llama.cpp's ids.
    """
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    reader = gguf.GGUFReader(str(gguf_path))
    field = lambda name: reader.fields[name].contents()  # noqa: E731
    tokens: list[str] = field("tokenizer.ggml.tokens")
    types: list[int] = field("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    tok = Tokenizer(bpe)
    # llama.cpp's "smollm" pre-tokenizer: digits one by one, then GPT-2's byte-level split.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in (3, 4)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=tokens[int(field("tokenizer.ggml.eos_token_id"))],
        bos_token=tokens[int(field("tokenizer.ggml.bos_token_id"))],
        unk_token=tokens[int(field("tokenizer.ggml.unknown_token_id"))],
        pad_token=tokens[int(field("tokenizer.ggml.padding_token_id"))],
        chat_template=field("tokenizer.chat_template"),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return out_dir


def deal_groups(player, seed: int, config):
    """The groups one deal yields, played by the deal runner (no concurrency limit)."""
    import asyncio

    from blackjack_rl.rollout.runner import DealRunner

    return asyncio.run(DealRunner(player, config).deal(seed)).groups


class ScoringStub:
    """A policy that only scores given answers (`answer_logprobs_many`, which a subclass
    defines): what rollout credit and the exact tree ask of a model, without one."""

    name = "scoring-stub"
    temperature = 1.0

    async def answer_logprobs(self, prompt_ids, answers, temperature=None):
        return (await self.answer_logprobs_many([(prompt_ids, answers)]))[0]

    def generation_params(self):
        return {}

    async def respond(self, turn):
        raise NotImplementedError("a scoring stub does not sample")

    async def aclose(self):
        pass
