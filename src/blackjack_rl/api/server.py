"""The trajectory API: Atropos' endpoints and fields, on a durable, bounded, checked queue.

`create_app(config)` builds a fresh FastAPI app; all state (the SQLite store and its writer
thread) is created by the app's lifespan and hangs off `app.state`, so two apps never share
anything and tests can start as many as they like.
"""

from __future__ import annotations

import hmac
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio.to_thread
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from blackjack_rl.api.body import content_coding, gunzip_limited, read_limited, receive_limited
from blackjack_rl.api.errors import ApiError
from blackjack_rl.api.ingest import decode_payload, payload_parts
from blackjack_rl.api.ingest_workers import IngestPool
from blackjack_rl.api.models import EnvIdentifier, Registration, RegisterEnv
from blackjack_rl.api.settings import ApiConfig
from blackjack_rl.api.store import BatchRows, Store, StoreRunner

M = TypeVar("M", bound=BaseModel)

_MAX_IDEMPOTENCY_KEY = 200
_INLINE_BODY = 64 * 1024  # plain bodies up to this size are parsed on the event loop
_EMPTY_EXAMPLE: dict[str, list[Any]] = {
    name: []
    for name in (
        "tokens",
        "masks",
        "scores",
        "advantages",
        "ref_logprobs",
        "generation_params",
        "inference_logprobs",
        "messages",
        "images",
    )
}


class BearerAuth:
    """Require `Authorization: Bearer <token>` on every request (ASGI, so it costs ~nothing)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                response = JSONResponse(
                    {"detail": "missing or wrong bearer token; send the header 'Authorization: Bearer <token>'"},
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


_NO_BATCH = b'{"batch":null}'
#: The one query string (besides none) with which GET /batch skips FastAPI: FastAPI checks any other.
_PLAIN_ACK = re.compile(rb"ack=[0-9]{1,18}")
#: The ingest endpoints, and whether each takes a list of groups.
_INGEST_PATHS = {"/scored_data": False, "/scored_data_list": True}
IngestHandler = Callable[[Scope, Receive, Send, bool], Awaitable[None]]
BatchHandler = Callable[[Scope, Receive, Send, "int | None"], Awaitable[None]]


def _route_path(scope: Scope) -> str:
    """The path the router matches: without the root path the app may be mounted under."""
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] == "/":
        return path[len(root) :]
    return path


class TrajectoryApp(FastAPI):
    """FastAPI, with the ingest endpoints answered straight from ASGI when nothing else applies.

    Posting groups is what the API does thousands of times a second, and FastAPI's layers
    (its middleware stack, routing, the request object, serialising the answer) cost about
    as much as the rest of the server's work on a post. A POST to /scored_data or
    /scored_data_list skips them when none of them would change the answer: the bearer
    token, if one is configured, is the right one (a wrong one gets its 401 from the
    middleware), CORS is off or the request has no Origin header, and FastAPI's own
    OpenTelemetry instrumentation is off. Everything else, and every other endpoint, takes
    the full stack; both paths run the same `ingest` and answer with the same bytes.

    Under the same conditions a trainer's GET /batch (with no query, or only a plain `ack`)
    skips them too; one that can only be answered `{"batch":null}` (nothing in flight to
    acknowledge, fewer sequences queued than a batch holds) is answered at once, without a
    transaction: trainers poll while they wait.
    """

    fast_ingest: IngestHandler | None = None
    fast_batch: BatchHandler | None = None
    fast_token: bytes | None = None
    fast_cors: bool = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            method = scope["method"]
            if method == "POST" and self.fast_ingest is not None:
                as_list = _INGEST_PATHS.get(_route_path(scope))
                if as_list is not None and self._fast_path_applies(scope):
                    await self.fast_ingest(scope, receive, send, as_list)
                    return
            elif method == "GET" and self.fast_batch is not None and _route_path(scope) == "/batch":
                query = scope["query_string"]
                if (not query or _PLAIN_ACK.fullmatch(query)) and self._fast_path_applies(scope):
                    await self.fast_batch(scope, receive, send, int(query[4:]) if query else None)
                    return
        await super().__call__(scope, receive, send)

    def _fast_path_applies(self, scope: Scope) -> bool:
        if self.fast_token is not None or self.fast_cors:
            given: bytes | None = None  # the first Authorization header, as BearerAuth reads it
            for name, value in scope["headers"]:
                if name == b"authorization" and given is None:
                    given = value
                elif name == b"origin" and self.fast_cors:
                    return False
            if self.fast_token is not None and not hmac.compare_digest(given or b"", self.fast_token):
                return False
        return not self._telemetry_on()

    _telemetry_checked = -1.0
    _telemetry_was_on = False

    def _telemetry_on(self) -> bool:
        """Whether FastAPI's OpenTelemetry instrumentation is on, asked at most once a second
        (asking looks up OpenTelemetry's global providers and environment variables)."""
        now = time.monotonic()
        if now - self._telemetry_checked >= 1.0:
            telemetry = getattr(self, "_native_telemetry", None)  # FastAPI's own, in recent versions
            self._telemetry_was_on = telemetry is not None and bool(telemetry.enabled())
            self._telemetry_checked = now
        return self._telemetry_was_on


def create_app(config: ApiConfig) -> TrajectoryApp:
    """A new trajectory API app for `config` (serve it with uvicorn, or test it in-process)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = Store(
            config.db_path,
            synchronous=config.synchronous,
            max_queued_sequences=config.max_queued_sequences,
            retry_after_s=config.retry_after_s,
            idempotency_ttl_s=config.idempotency_ttl_s,
            env_lease_s=config.env_lease_s,
        )
        runner = StoreRunner(store)
        runner.start()
        app.state.runner = runner
        pool = IngestPool(config.ingest_workers)
        app.state.pool = pool
        try:
            await pool.start()
            yield
        finally:
            await pool.aclose()
            await anyio.to_thread.run_sync(runner.stop)

    app = TrajectoryApp(
        title="blackjack-rl trajectory API",
        description="Atropos-compatible trajectory API: a durable, bounded queue of scored groups.",
        lifespan=lifespan,
    )
    token = config.token_value()
    if token:
        app.add_middleware(BearerAuth, token=token)
    if config.cors_origins:
        # Added last, so it runs first: browsers' preflight requests carry no token.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "Content-Encoding", "Idempotency-Key"],
        )

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse({"detail": exc.detail}, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _bad_params(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [f"{'.'.join(str(p) for p in e['loc'][1:]) or 'request'}: {e['msg']}" for e in exc.errors()]
        return JSONResponse({"detail": "; ".join(parts)}, status_code=422)

    def runner_of(request: Request) -> StoreRunner:
        return request.app.state.runner  # type: ignore[no-any-return]

    async def call(request: Request, op: Callable[[Store], Any]) -> Any:
        return await runner_of(request).call(op)

    async def read_body(request: Request) -> tuple[bytes, str]:
        raw = await read_limited(request.stream(), request.headers.get("content-length"), config.max_body_bytes)
        return raw, content_coding(request.headers.get("content-encoding"))

    def decode(raw: bytes, coding: str, model: type[M]) -> M:
        text = gunzip_limited(raw, config.max_body_bytes)[0] if coding == "gzip" else raw
        try:
            return model.model_validate_json(text or b"null")
        except ValidationError as exc:
            raise _request_error(exc, model.__name__) from None

    async def parse(request: Request, model: type[M]) -> M:
        raw, coding = await read_body(request)
        if coding == "identity" and len(raw) <= _INLINE_BODY:
            return decode(raw, coding, model)  # the usual tiny JSON: not worth a thread hop
        return await anyio.to_thread.run_sync(decode, raw, coding, model)

    @app.get("/")
    async def root() -> dict[str, str]:
        return {"message": "blackjack-rl trajectory API (Atropos-compatible)"}

    @app.post("/register")
    async def register(request: Request) -> dict[str, int]:
        reg = await parse(request, Registration)
        return {"uuid": await call(request, lambda s: s.register_trainer(reg))}

    @app.post("/register-env")
    async def register_env(request: Request) -> dict[str, Any]:
        req = await parse(request, RegisterEnv)
        return await call(request, lambda s: s.register_env(req))  # type: ignore[no-any-return]

    @app.post("/disconnect-env")
    async def disconnect_env(request: Request) -> dict[str, Any]:
        ident = await parse(request, EnvIdentifier)
        return await call(request, lambda s: s.disconnect_env(ident.env_id))  # type: ignore[no-any-return]

    @app.get("/wandb_info")
    async def wandb_info(request: Request) -> dict[str, Any]:
        return await call(request, Store.wandb_info)  # type: ignore[no-any-return]

    @app.get("/info")
    async def info(request: Request) -> dict[str, Any]:
        return await call(request, Store.info)  # type: ignore[no-any-return]

    @app.get("/status")
    async def status(request: Request) -> dict[str, Any]:
        return await call(request, Store.status)  # type: ignore[no-any-return]

    @app.get("/status-env")
    async def status_env(request: Request, env_id: int | None = Query(None, ge=0, lt=2**63)) -> dict[str, Any]:
        """env_id as a query parameter, or (as atroposlib sends it) as a JSON body on GET."""
        if env_id is None:
            env_id = (await parse(request, EnvIdentifier)).env_id
        chosen = env_id
        return await call(request, lambda s: s.status_env(chosen))  # type: ignore[no-any-return]

    @app.get("/batch")
    async def batch(request: Request, ack: int | None = Query(None, ge=0, lt=2**63)) -> Response:
        """The next batch for the trainer; see Store.next_batch for acknowledgement."""
        return await next_batch(runner_of(request), ack)

    async def next_batch(runner: StoreRunner, ack: int | None) -> Response:
        if no_batch_yet(runner):
            return Response(_NO_BATCH, media_type="application/json")
        if runner.store.mirror.trainer is None:
            return JSONResponse(
                {"status": "error", "message": "Trainer not registered. Call /register first.", "batch": []}
            )
        rows = await runner.call(lambda s: s.next_batch(ack))
        if rows is None:
            return Response(_NO_BATCH, media_type="application/json")
        return _ChunksResponse(await anyio.to_thread.run_sync(_batch_chunks, rows))

    def no_batch_yet(runner: StoreRunner) -> bool:
        """Whether GET /batch can only answer null and change nothing: then no transaction is needed."""
        store = runner.store
        # The count first: the writer thread sets `inflight` before it lowers the count, so a
        # low count read here is never one from which a batch was taken but is not yet in flight.
        queued = store.queued_sequences_hint
        m = store.mirror
        trainer = m.trainer
        return trainer is not None and m.started and m.inflight is None and queued < trainer.batch_size

    async def fast_batch(scope: Scope, receive: Receive, send: Send, ack: int | None) -> None:
        """The `batch` endpoint without FastAPI (see TrajectoryApp): the same answers and errors."""
        await _answered(scope, receive, send, next_batch(app.state.runner, ack))

    app.fast_batch = fast_batch

    @app.get("/latest_example")
    async def latest_example(request: Request) -> Response:
        latest = runner_of(request).store.latest
        if latest is None:
            return JSONResponse(_EMPTY_EXAMPLE)
        return Response(await anyio.to_thread.run_sync(decode_payload, *latest), media_type="application/json")

    async def ingest(
        runner: StoreRunner, pool: IngestPool, raw: bytes, coding: str, key: str | None, as_list: bool
    ) -> dict[str, Any]:
        if key is not None and not 0 < len(key) <= _MAX_IDEMPOTENCY_KEY:
            raise ApiError(400, f"Idempotency-Key must be 1 to {_MAX_IDEMPOTENCY_KEY} characters")
        if runner.store.queued_sequences_hint >= config.max_queued_sequences:
            # Cheap early refusal; the store makes the exact check when it queues.
            raise ApiError(
                503,
                f"queue is full ({config.max_queued_sequences} sequences wait for the trainer); "
                f"retry after {config.retry_after_s} s",
                {"Retry-After": str(config.retry_after_s)},
            )
        ctx = runner.store.context
        groups, digest = await pool.prepare(
            raw, coding, ctx, as_list=as_list, max_bytes=config.max_body_bytes, with_digest=key is not None
        )
        return await runner.call(  # type: ignore[no-any-return]
            lambda s: s.enqueue(groups, as_list=as_list, idempotency_key=key, generation=ctx.generation, digest=digest)
        )

    async def ingest_request(request: Request, as_list: bool) -> dict[str, Any]:
        raw, coding = await read_body(request)
        return await ingest(
            runner_of(request), request.app.state.pool, raw, coding, request.headers.get("idempotency-key"), as_list
        )

    async def fast_ingest(scope: Scope, receive: Receive, send: Send, as_list: bool) -> None:
        """`ingest_request` without FastAPI (see TrajectoryApp): the same checks, answers and errors."""
        length = encoding = key = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = length if length is not None else value.decode("latin-1")
            elif name == b"content-encoding":
                encoding = encoding if encoding is not None else value.decode("latin-1")
            elif name == b"idempotency-key":
                key = key if key is not None else value.decode("latin-1")
        state = app.state
        try:
            raw = await receive_limited(receive, length, config.max_body_bytes)
        except ClientDisconnect:
            return  # nobody is left to answer
        except ApiError as exc:
            await (await _api_error(None, exc))(scope, receive, send)  # type: ignore[arg-type]
            return
        await _answered(scope, receive, send, _ingest_answer(state, raw, encoding, key, as_list))

    async def _ingest_answer(state: Any, raw: bytes, encoding: str | None, key: str | None, as_list: bool) -> Response:
        answer = await ingest(state.runner, state.pool, raw, content_coding(encoding), key, as_list)
        return _answer_response(answer)

    async def _answered(scope: Scope, receive: Receive, send: Send, making: Awaitable[Response]) -> None:
        """Send the response `making` gives, or what FastAPI's layers answer for its exception."""
        try:
            response = await making
        except ApiError as exc:
            response = await _api_error(None, exc)  # type: ignore[arg-type]
        except Exception:
            # What Starlette's ServerErrorMiddleware answers; uvicorn logs the exception.
            await PlainTextResponse("Internal Server Error", status_code=500)(scope, receive, send)
            raise
        await response(scope, receive, send)

    app.fast_ingest = fast_ingest
    app.fast_token = f"Bearer {token}".encode() if token else None
    app.fast_cors = bool(config.cors_origins)

    @app.post("/scored_data")
    async def scored_data(request: Request) -> dict[str, Any]:
        return await ingest_request(request, as_list=False)

    @app.post("/scored_data_list")
    async def scored_data_list(request: Request) -> dict[str, Any]:
        return await ingest_request(request, as_list=True)

    async def reset(request: Request) -> Response:
        if not token:
            raise ApiError(
                403,
                "reset_data is disabled: it deletes every registration and queued group. "
                "Start the API with a token (--token or BLACKJACK_RL_API_TOKEN) to allow it.",
            )
        await call(request, Store.reset)
        return PlainTextResponse("Reset successful")

    app.add_api_route("/reset_data", reset, methods=["GET", "POST"])
    return app


_RECEIVED = b'{"status":"received"}'


def _answer_response(answer: dict[str, Any]) -> Response:
    """JSONResponse(answer), without json.dumps for the answers every post gets."""
    if answer == {"status": "received"}:
        return Response(_RECEIVED, media_type="application/json")
    if list(answer) == ["status", "groups_processed"] and answer["status"] == "received" and type(answer["groups_processed"]) is int:
        body = b'{"status":"received","groups_processed":%d}' % answer["groups_processed"]
        return Response(body, media_type="application/json")
    return JSONResponse(answer)


#: Pieces of a batch at least this large are sent as they are; smaller ones are joined first.
_SENT_WHOLE = 32 * 1024


def _batch_chunks(rows: BatchRows) -> list[bytes | memoryview]:
    """The body of GET /batch as chunks to send one after the other.

    Each group's decompressed JSON is sent from its own buffer: joining them would copy the
    whole batch (megabytes) into a fresh allocation, which costs more in page faults than the
    copy itself. Only the small pieces between groups are joined.
    """
    chunks: list[bytes | memoryview] = []
    small: list[bytes | memoryview] = [b'{"batch":[']
    for i, (fmt, data, suffix) in enumerate(rows.payloads):
        if i:
            small.append(b",")
        for part in payload_parts(fmt, data, suffix):
            if len(part) >= _SENT_WHOLE:
                if small:
                    chunks.append(b"".join(small))
                    small = []
                chunks.append(part)
            else:
                small.append(part)
    small.append(b'],"batch_id":%d,"step":%d,"redelivered":%s}' % (
        rows.batch_id,
        rows.step,
        b"true" if rows.redelivered else b"false",
    ))
    chunks.append(b"".join(small))
    return chunks


class _ChunksResponse(Response):
    """A JSON body sent as the chunks it is made of, with its Content-Length (no copy into one buffer)."""

    media_type = "application/json"

    def __init__(self, chunks: list[bytes | memoryview]) -> None:
        self.chunks = chunks
        super().__init__(headers={"content-length": str(sum(len(c) for c in chunks))})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        last = len(self.chunks) - 1
        for i, chunk in enumerate(self.chunks):
            await send({"type": "http.response.body", "body": chunk, "more_body": i < last})


def _request_error(exc: ValidationError, what: str) -> ApiError:
    errors = exc.errors(include_url=False)
    if errors[0]["type"] == "json_invalid":
        return ApiError(400, f"body is not valid JSON: {errors[0]['msg']}")
    parts = []
    for e in errors[:4]:
        loc = ".".join(str(p) for p in e["loc"]) or "body"
        parts.append(f"{loc}: {e['msg']}")
    return ApiError(422, f"{what}: " + "; ".join(parts))


__all__ = ["ApiConfig", "TrajectoryApp", "create_app"]
