"""An exclusive lock on an SQLite file that follows the file, not its name.

The trajectory API's queue and a worker's outbox each belong to one process: two writers
with separate WAL files (SQLite names them after the path) lose data. The lock is an
`flock` on the database file itself, so a second process reaching the same file through a
hard link or a symlink is refused as well.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

try:  # POSIX advisory lock
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


class DatabaseInUse(OSError):
    """The file is held by another process (or cannot be opened): one clear line for the user."""


#: (st_dev, st_ino) of the database files this process holds. Asking the kernel again from
#: the same process would mean opening and closing a second descriptor of a file SQLite has
#: open, and closing any descriptor drops the POSIX locks SQLite holds on it.
_HELD: set[tuple[int, int]] = set()


class DatabaseLock:
    """An exclusive flock on the database file itself, held until `release()`.

    `owner` names the kind of process ("trajectory API") and `fix` says how to give this one
    a file of its own ("give this one its own --db"), for the one-line error.
    """

    def __init__(self, path: Path, owner: str, fix: str) -> None:
        self.path = path
        if path.exists() and not path.is_file():
            raise DatabaseInUse(f"{path} is not a file; give the path of an SQLite file (it is created)")
        in_use = DatabaseInUse(f"another {owner} process is using {path} (or another name of the same file); {fix}")
        if path.exists() and _identity(path) in _HELD:
            raise in_use
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._handle: BinaryIO | None = open(path, "ab")  # noqa: SIM115 - held until release(); creates the file
            self.identity = _identity(path)
        except OSError as exc:
            file = next((p for p in path.parents if p.is_file()), None)  # mkdir's EEXIST would not say which
            why = f"{file} is a file, not a folder" if file is not None else exc.strerror or exc
            raise DatabaseInUse(f"cannot open {path}: {why}") from None
        if fcntl is not None:
            try:
                fcntl.flock(self._handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._handle.close()  # another process holds it: this process has no SQLite on it
                raise in_use from None
        _HELD.add(self.identity)

    def release(self) -> None:
        """Call after closing the SQLite connection (see _HELD)."""
        if self._handle is not None:
            _HELD.discard(self.identity)
            self._handle.close()
            self._handle = None


def _identity(path: Path) -> tuple[int, int]:
    st = path.stat()
    return (st.st_dev, st.st_ino)


def take_lock(
    path: str | os.PathLike[str], owner: str = "trajectory API", fix: str = "stop it, or give this one its own --db"
) -> DatabaseLock:
    """Hold a database exclusively: two processes writing one SQLite file would disagree on its state."""
    return DatabaseLock(Path(path), owner, fix)
