"""Reading request bodies with hard limits: size as sent, size after gzip, no gzip bombs.

Atropos reads and decompresses whole bodies with no limit, so one 49 MB post or a 10 KB
gzip bomb takes the server's memory. Here the compressed body is read up to the limit and
decompressed incrementally with an output cap: memory stays bounded by `max_bytes`.
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator

from starlette.requests import ClientDisconnect
from starlette.types import Receive

from blackjack_rl.api.errors import ApiError

try:  # ISA-L's inflate: the same streams and checks as zlib's, ~2.5x faster
    from isal import isal_zlib as fast_zlib
except ImportError:  # a platform isal does not build on: the stdlib does the same work
    fast_zlib = None  # type: ignore[assignment]

_GZIP_WBITS = 16 + zlib.MAX_WBITS
#: Bytes of compressed input handed to zlib at a time (bounds the copy zlib makes per member).
_FEED = 16 * 1024
#: Gzip members accepted in one body. Clients (EnvClient, atroposlib) send one; a body made of
#: many tiny members costs per member, so their number is bounded rather than their size only.
MAX_GZIP_MEMBERS = 64


def _too_large(limit: int, what: str) -> ApiError:
    return ApiError(
        413,
        f"{what} exceeds the limit of {limit} bytes; send fewer groups per request "
        "(or raise the server's --max-body-mb)",
    )


def check_declared_length(content_length: str | None, limit: int) -> None:
    """Refuse a body by its Content-Length before reading any of it."""
    if content_length is not None:
        try:
            declared = int(content_length)
        except ValueError:
            raise ApiError(400, f"Content-Length {content_length!r} is not a number") from None
        if declared > limit:
            raise _too_large(limit, f"body of {declared} bytes")


async def read_limited(stream: AsyncIterator[bytes], content_length: str | None, limit: int) -> bytes:
    """The raw body, refusing early (from Content-Length) or as soon as it passes `limit`."""
    check_declared_length(content_length, limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in stream:
        size += len(chunk)
        if size > limit:
            raise _too_large(limit, "body")
        chunks.append(chunk)
    return b"".join(chunks)


async def receive_limited(receive: Receive, content_length: str | None, limit: int) -> bytes:
    """`read_limited` straight from ASGI messages (as Starlette's request.stream() reads them)."""
    check_declared_length(content_length, limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.request":
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit, "body")
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        elif message["type"] == "http.disconnect":
            raise ClientDisconnect()
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def content_coding(header: str | None) -> str:
    """'identity' or 'gzip'; anything else is refused with 415 naming what is supported."""
    coding = (header or "identity").strip().lower()
    if coding in ("", "identity"):
        return "identity"
    if coding in ("gzip", "x-gzip"):
        return "gzip"
    raise ApiError(415, f"Content-Encoding {header!r} is not supported; send identity or gzip")


def gunzip_limited(data: bytes, limit: int, max_members: int = MAX_GZIP_MEMBERS) -> tuple[bytes, int]:
    """Decompress a gzip body (one or more members) producing at most `limit` bytes.

    Returns the bytes and the number of gzip members, so callers can tell a plain single
    stream (whose compressed bytes may be stored as they are) from a concatenation.

    Linear in the body: input is fed in slices of `_FEED` bytes, so what zlib copies per
    member (its unused input) is bounded by the slice, not by the rest of the body, and
    bodies of more than `max_members` members (clients send one) are refused.

    The usual body, one stream within the limit, is decompressed by ISA-L in one call; any
    other body (several members, padding, too large, damaged) is then read by the stdlib as
    below, so what is refused, and how, is the stdlib's.
    """
    one = _one_stream(data, limit)
    if one is not None:
        return one, 1
    view = memoryview(data)
    size = len(view)
    out: list[bytes] = []
    produced = 0
    members = 0
    pos = 0
    while pos < size:
        if view[pos] == 0 and not bytes(view[pos:]).strip(b"\x00"):
            break  # zero padding after the last member, as some writers add
        members += 1
        if members > max_members:
            raise ApiError(
                400,
                f"gzip body has more than {max_members} members; compress the body as one gzip stream",
            )
        decoder = zlib.decompressobj(_GZIP_WBITS)
        while not decoder.eof:
            if pos >= size:
                raise ApiError(400, "gzip body is truncated; send the complete compressed stream")
            pending: bytes | memoryview = view[pos : pos + _FEED]
            pos += len(pending)
            while True:
                try:
                    piece = decoder.decompress(pending, limit - produced + 1)
                except zlib.error as exc:
                    raise ApiError(
                        400, f"body is not valid gzip ({exc}); compress with gzip or send it plain"
                    ) from None
                produced += len(piece)
                if produced > limit:
                    raise _too_large(limit, "decompressed body")
                out.append(piece)
                if decoder.eof:
                    pos -= len(decoder.unused_data)  # the next member starts there
                    break
                pending = decoder.unconsumed_tail
                if not pending:
                    break
    if members == 0:
        return b"", 0
    return b"".join(out), members


def _one_stream(data: bytes, limit: int) -> bytes | None:
    """`data` decompressed by ISA-L when it is exactly one complete gzip stream of at most
    `limit` bytes (its CRC and length checked), else None. Output stops at `limit` + 1 bytes."""
    if fast_zlib is None or not data:
        return None
    decoder = fast_zlib.decompressobj(_GZIP_WBITS)
    try:
        out = decoder.decompress(data, limit + 1)
    except Exception:  # noqa: BLE001 - isal's own error type; the stdlib path names the problem
        return None
    if decoder.eof and not decoder.unused_data and len(out) <= limit:
        return out
    return None
