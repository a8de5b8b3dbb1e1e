"""A stand-in for a vLLM OpenAI-compatible server, written from vLLM's documented API, with faults.

What it implements (vLLM's shapes):
- `POST /v1/completions`: `prompt` as a list of token ids (or a string), `n`, `seed`,
  `max_tokens`, `logprobs`, `return_tokens_as_token_ids`. Each choice has `text`,
  `logprobs.tokens` ("token_id:N" strings when asked, else text pieces),
  `logprobs.token_logprobs`, `finish_reason` ("stop" | "length") and `stop_reason`
  (None when the EOS token ended it; vLLM keeps that EOS id in the returned tokens).
  Choice i of a seeded n-request samples like a single request seeded `seed + i`, as
  vLLM seeds the children of a parallel-sampling request.
- `POST /v1/chat/completions` with `n`; `GET /v1/models`; `GET /health`.

The "model" picks one of a fixed list of answers (token ids, text) with a seeded RNG,
so tests know exactly which ids the server returned. Faults are switched on at run
time with `POST /_control` (see `Control`), and `GET /_stats` returns request counts
and a log of every completion returned, to compare trained ids against.

Run: python tests/mock_openai_server.py --port PORT --config answers.json [--raw]
(FastAPI on uvicorn; `--raw`: the same behaviour on a minimal asyncio HTTP/1.1 server,
for benchmarks that must measure the client rather than the server). Binds 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response
from helpers import free_port, kill_process, wait_until_up


@dataclass
class Control:
    latency_ms: float = 0.0  # added to every generation request
    status: int = 0  # answer generation requests with this HTTP status (0: off)
    fail_times: int = -1  # how many requests `status`/`malformed`/`hang` apply to (-1: all)
    malformed: bool = False  # HTTP 200 with a body that is not JSON
    bad_shape: bool = False  # HTTP 200 JSON without logprobs
    hang: bool = False  # never answer generation requests
    ignore_n: bool = False  # one choice whatever `n` says (like llama-cpp-python)
    omit_eos: bool = False  # stop on EOS but leave it out of the tokens
    record: bool = True  # keep a log of returned completions for /_stats


@dataclass
class State:
    answers: list[dict[str, Any]]  # {"ids": [...], "text": "...", "weight": w}
    eos: int
    model: str
    control: Control = field(default_factory=Control)
    requests: dict[str, int] = field(default_factory=dict)
    log: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    unhang: asyncio.Event = field(default_factory=asyncio.Event)  # set on reset: hung requests return


Answer = tuple[int, Any]  # (HTTP status, a JSON-able object or raw bytes)


class Behaviour:
    """What the server answers, apart from any HTTP layer (FastAPI for tests, raw asyncio for benchmarks)."""

    def __init__(self, state: State) -> None:
        self.state = state
        self.weights = [a.get("weight", 1.0) for a in state.answers]
        self.routes = {
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/chat/completions"): self.chat,
            ("GET", "/v1/models"): self.models,
            ("GET", "/health"): self.health,
            ("POST", "/_control"): self.control,
            ("GET", "/_stats"): self.stats,
        }

    async def handle(self, method: str, path: str, body: bytes) -> Answer:
        route = self.routes.get((method, path))
        if route is None:
            return 404, {"error": {"message": f"no route {method} {path}"}}
        return await route(body)

    def sample(self, seed: int | None) -> dict[str, Any]:
        rng = random.Random(seed) if seed is not None else random
        return rng.choices(self.state.answers, self.weights)[0]

    async def fault(self, path: str) -> Answer | None:
        state = self.state
        state.requests[path] = state.requests.get(path, 0) + 1
        c = state.control
        if c.latency_ms:
            await asyncio.sleep(c.latency_ms / 1000)
        active = c.fail_times != 0
        if active and c.fail_times > 0 and (c.status or c.malformed or c.hang):
            c.fail_times -= 1
        if not active:
            return None
        if c.hang:
            try:
                await asyncio.wait_for(state.unhang.wait(), 3600)
            except asyncio.TimeoutError:
                pass
            return 503, {"error": {"message": "released after hanging"}}
        if c.status:
            return c.status, {"error": {"message": "injected failure", "code": c.status}}
        if c.malformed:
            return 200, b'{"choices": [{"text": "trunc'
        return None

    async def completions(self, raw: bytes) -> Answer:
        state = self.state
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        try:
            if (bad := await self.fault("/v1/completions")) is not None:
                return bad
            return self._complete(json.loads(raw))
        finally:
            state.in_flight -= 1

    def _complete(self, body: dict[str, Any]) -> Answer:
        state = self.state
        if body.get("model") != state.model:
            return 404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}}
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))):
            return 400, {"error": {"message": "prompt must be a string or a list of token ids"}}
        n = 1 if state.control.ignore_n else int(body.get("n", 1))
        seed = body.get("seed")
        max_tokens = int(body.get("max_tokens", 16))
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        choices, returned = [], []
        for i in range(n):
            answer = self.sample(None if seed is None else seed + i)
            ids = list(answer["ids"])[:max_tokens]
            stopped = len(ids) == len(answer["ids"]) and ids and ids[-1] == state.eos
            if stopped and state.control.omit_eos:
                ids = ids[:-1]
            logprobs = [-((7 * t) % 97 + 1) / 100.0 for t in ids]
            choice: dict[str, Any] = {
                "index": i,
                "text": answer["text"],
                "finish_reason": "stop" if stopped else "length",
                "stop_reason": None,
            }
            if body.get("logprobs") is not None and not state.control.bad_shape:
                choice["logprobs"] = {
                    "text_offset": list(range(len(ids))),
                    "token_logprobs": logprobs,
                    "tokens": [f"token_id:{t}" if as_ids else f"<{t}>" for t in ids],
                    "top_logprobs": None,
                }
            choices.append(choice)
            returned.append({"ids": ids, "logprobs": logprobs})
        if state.control.record and isinstance(prompt, list):
            state.log.append({"prompt": prompt, "choices": returned})
        return 200, {"id": "cmpl-mock", "object": "text_completion", "model": state.model, "choices": choices,
                     "usage": {"prompt_tokens": len(prompt), "completion_tokens": 0}}

    async def chat(self, raw: bytes) -> Answer:
        if (bad := await self.fault("/v1/chat/completions")) is not None:
            return bad
        body = json.loads(raw)
        if body.get("model") != self.state.model:
            return 404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}}
        n = 1 if self.state.control.ignore_n else int(body.get("n", 1))
        seed = body.get("seed")
        choices = [
            {"index": i, "message": {"role": "assistant", "content": self.sample(None if seed is None else seed + i)["text"]},
             "finish_reason": "stop"}
            for i in range(n)
        ]
        return 200, {"id": "chatcmpl-mock", "object": "chat.completion", "model": self.state.model, "choices": choices}

    async def models(self, raw: bytes) -> Answer:
        return 200, {"object": "list", "data": [{"id": self.state.model, "object": "model", "owned_by": "vllm"}]}

    async def health(self, raw: bytes) -> Answer:
        return 200, b""

    async def control(self, raw: bytes) -> Answer:
        state, body = self.state, json.loads(raw)
        if body.pop("reset", False):
            state.control = Control()
            state.unhang.set()
            state.unhang = asyncio.Event()
            await asyncio.sleep(0.01)  # let released requests finish before counting again
            state.requests.clear()
            state.log.clear()
            state.max_in_flight = 0
        for key, value in body.items():
            if not hasattr(state.control, key):
                return 400, {"error": f"unknown control {key}"}
            setattr(state.control, key, value)
        return 200, asdict(state.control)

    async def stats(self, raw: bytes) -> Answer:
        s = self.state
        return 200, {"requests": s.requests, "log": s.log, "max_in_flight": s.max_in_flight}


def _encode(payload: Any) -> bytes:
    return payload if isinstance(payload, bytes) else json.dumps(payload).encode()


def build_app(state: State) -> FastAPI:
    behaviour = Behaviour(state)
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    def route(method: str, path: str) -> None:
        async def endpoint(request: Request) -> Response:
            status, payload = await behaviour.handle(method, path, await request.body())
            return Response(_encode(payload), status_code=status, media_type="application/json")

        app.add_api_route(path, endpoint, methods=[method])

    for method, path in behaviour.routes:
        route(method, path)
    return app


async def serve_raw(state: State, port: int) -> None:
    """The same behaviour over a minimal HTTP/1.1 keep-alive server on asyncio streams: a
    mock cheap enough that benchmarks measure the client, not the server."""
    behaviour = Behaviour(state)

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                method, path, _ = line.decode("latin-1").split(" ", 2)
                length = 0
                while (header := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = header.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length) if length else b""
                status, payload = await behaviour.handle(method, path, body)
                data = _encode(payload)
                writer.write(b"HTTP/1.1 %d MOCK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                             % (status, len(data)) + data)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(connection, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


class MockServer:
    """One mock server in its own process (so it can hang, or be killed by PID, for real)."""

    def __init__(self, config_path: str | Path, raw: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.root = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--port", str(self.port), "--config", str(config_path)] + (["--raw"] if raw else []),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            wait_until_up(f"{self.root}/health", self.proc, "the mock server")
        except (RuntimeError, AssertionError):
            self.kill()
            raise

    def control(self, **settings: Any) -> dict[str, Any]:
        return httpx.post(f"{self.root}/_control", json=settings, timeout=5).json()

    def stats(self) -> dict[str, Any]:
        return httpx.get(f"{self.root}/_stats", timeout=10).json()

    def kill(self) -> None:
        kill_process(self.proc)


def write_config(path: str | Path, answers: list[dict[str, Any]], eos: int, model: str = "mock") -> Path:
    path = Path(path)
    path.write_text(json.dumps({"answers": answers, "eos": eos, "model": model}), encoding="utf-8")
    return path


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--config", required=True, help='JSON: {"answers": [{"ids", "text", "weight"}], "eos": id, "model": name}')
    parser.add_argument("--raw", action="store_true", help="serve with the minimal asyncio HTTP layer (benchmarks)")
    args = parser.parse_args()
    with open(args.config, encoding="utf-8") as fh:
        cfg = json.load(fh)
    state = State(answers=cfg["answers"], eos=int(cfg["eos"]), model=cfg.get("model", "mock"))
    if args.raw:
        asyncio.run(serve_raw(state, args.port))
    else:
        uvicorn.run(build_app(state), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)



def blackjack_answers(chat: Any) -> list[dict[str, Any]]:
    """Answers a Blackjack player might give, as ids of `chat`'s tokenizer: calls that hit or
    stick (closed by the end-of-turn id), a wordy invalid answer, and one that never ends."""
    from blackjack_rl.contract.protocol import HIT, STICK, tool_call_text

    eot = list(chat.end_of_turn_ids)
    texts = [(tool_call_text(HIT), 4, True), (tool_call_text(STICK), 4, True),
             ("I would like to hit, please.", 1, True), ("Let me think about this hand. " * 8, 1, False)]
    return [{"ids": chat.backend.encode(t) + (eot if closed else []), "text": t, "weight": w} for t, w, closed in texts]


if __name__ == "__main__":
    main()
