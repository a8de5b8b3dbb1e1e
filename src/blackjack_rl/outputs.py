"""Output files that are either whole or absent.

A run that fails half way must not leave a folder that looks like a finished run: a
half-written samples.jsonl next to an old metrics.json would be read back by `compare`
as if it were complete. So every file is written under a temporary name in its own
folder and renamed over the real name only once it is whole (a rename within one
filesystem is atomic), and each job writes its completion marker (metrics.json) last.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator, TextIO


class OutputError(ValueError):
    """The output folder cannot be written: a user error, reported in one line."""


def prepare_folder(folder: str | Path, *stale: str) -> Path:
    """Create `folder`, prove it is writable before any work is done, and remove the files a
    previous run left under the names this run will write (so a failure cannot leave them
    looking like this run's results)."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
        for name in stale:
            (folder / name).unlink(missing_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot write to the output folder {folder}: {exc.strerror or exc}; "
                          "choose another one with --out") from None
    return folder


@contextlib.contextmanager
def writing(path: str | Path, keep_partial: bool = False) -> Iterator[TextIO]:
    """A text file that appears under `path` only when the block ends without an error.

    Until then it is `<name>.partial`; on an error (or Ctrl-C) that file is removed, or,
    with `keep_partial`, left under its telling name (what a long `process` run wrote
    before it was stopped is still worth having).
    """
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    # errors="replace": text from a model may hold lone surrogates, which UTF-8 cannot encode
    with partial.open("w", encoding="utf-8", errors="replace") as fh:
        try:
            yield fh
        except BaseException:
            fh.close()
            if not keep_partial:
                partial.unlink(missing_ok=True)
            raise
    os.replace(partial, path)


def write_text(path: str | Path, text: str) -> Path:
    """Write the whole of `text` to `path`, atomically."""
    with writing(path) as fh:
        fh.write(text)
    return Path(path)
