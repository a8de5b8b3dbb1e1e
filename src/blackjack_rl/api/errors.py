"""The one exception type the API turns into an HTTP error response."""

from __future__ import annotations


class ApiError(Exception):
    """A request the API refuses, with the status code and a message saying what to do.

    Raised anywhere below the HTTP layer (body reading, validation, the store); the server
    renders it as `{"detail": message}` so clients see the reason, never a bare 500.
    """

    def __init__(self, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.headers = headers or {}

    def __reduce__(self) -> tuple[type[ApiError], tuple[int, str, dict[str, str]]]:
        # Picklable, so validation may run in a worker process.
        return (ApiError, (self.status, self.detail, self.headers))
