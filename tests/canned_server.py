"""A real HTTP server on 127.0.0.1 that answers every POST with one fixed JSON body.

For answers no real server gives on purpose (content of the wrong type, odd fields):
the client under test goes through its whole HTTP stack, and the test states exactly
what came back. It runs in a daemon thread of the test process and stops on exit of
the `with` block; GET answers the model list, so pool probes see a live server
(or, with `get_status`, what POST answers, with that status).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class CannedServer:
    def __init__(self, answer: Any, status: int = 200, delay_s: float = 0.0, get_status: int = 200) -> None:
        self.answer, self.status, self.delay_s, self.get_status = answer, status, delay_s, get_status
        self.posts = self.gets = 0
        self.bodies: list[bytes] = []  # every POST body, in order
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                outer.bodies.append(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                outer.posts += 1
                time.sleep(outer.delay_s)  # a slow model: keeps a run going while a test stops it
                self._send(outer.status, outer.answer)

            def do_GET(self) -> None:  # noqa: N802
                outer.gets += 1
                if outer.get_status != 200:  # a server that is down for GETs too answers them as POSTs
                    self._send(outer.get_status, outer.answer)
                    return
                self._send(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})

            def _send(self, status: int, payload: Any) -> None:
                body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> "CannedServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)


def chat_answer(message: Any, *, n: int = 1, finish_reason: str = "stop") -> dict[str, Any]:
    """A chat completion whose every choice carries `message` as given."""
    return {"id": "chatcmpl-canned", "object": "chat.completion", "model": "m",
            "choices": [{"index": i, "message": message, "finish_reason": finish_reason} for i in range(n)]}
