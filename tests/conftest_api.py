"""Helpers for the trajectory API tests: groups, Atropos payloads, and real server processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

SRC = Path(__file__).resolve().parents[1] / "src"

#: What an Atropos trainer posts to /register (every field; Atropos' run-api refuses null).
ATROPOS_REGISTRATION: dict[str, Any] = {
    "wandb_group": "group",
    "wandb_project": "project",
    "batch_size": 8,
    "max_token_len": 512,
    "starting_step": 0,
    "checkpoint_dir": "checkpoints",
    "save_checkpoint_interval": 10,
    "num_steps": 100,
}


def atropos_register_env(group_size: int = 4, name: str = "blackjack", **changes: Any) -> dict[str, Any]:
    """What atroposlib 0.4.0 BaseEnv._register_env posts (min_batch_allocation None by default)."""
    body = {
        "max_token_length": 512,
        "desired_name": name,
        "weight": 1.0,
        "min_batch_allocation": None,
        "group_size": group_size,
    }
    body.update(changes)
    return body


def make_group(n: int = 4, length: int = 12, prompt: int = 5, env_id: int | None = 0, uid: str = "g") -> dict[str, Any]:
    """A valid group shaped like atroposlib's: optional fields as empty lists, our `episodes` extra."""
    tokens, masks, logprobs = [], [], []
    for i in range(n):
        seq = [(7 * i + j) % 50 + 1 for j in range(length)]
        tokens.append(seq)
        masks.append([-100] * prompt + seq[prompt:])
        logprobs.append([1.0] * prompt + [-0.5] * (length - prompt))
    return {
        "tokens": tokens,
        "masks": masks,
        "scores": [1.0 if i % 2 else -1.0 for i in range(n)],
        "inference_logprobs": logprobs,
        "advantages": [],
        "ref_logprobs": [],
        "messages": [],
        "group_overrides": {},
        "overrides": [],
        "images": [],
        "env_id": env_id,
        "episodes": [{"uid": uid, "index": i, "outcome": "win"} for i in range(n)],
    }


def uids(batch_groups: list[dict[str, Any]]) -> list[str]:
    return [g["episodes"][0]["uid"] for g in batch_groups]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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

    def start(self, timeout_s: float = 20.0) -> ServerProcess:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
        env.pop("BLACKJACK_RL_API_TOKEN", None)
        env.update(self.extra_env)
        cmd = self.command()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"API exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/status", headers=headers, timeout=1.0).status_code < 500:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"API did not answer within {timeout_s} s: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL: no shutdown handlers, no flush; only what SQLite committed survives."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

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
