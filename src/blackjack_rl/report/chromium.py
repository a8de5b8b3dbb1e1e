"""Headless Chromium for checking and photographing the pages (tests, docs screenshots).

Uses the system's Chromium (Debian's `chromium` package) through playwright, never a
browser that playwright would download: the machines that run this have no route to
one. Both are development tools (`pip install -e ".[dev]"`), imported only here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

CHROMIUM_FLAGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage",
]


def chromium_path() -> str:
    for candidate in (os.environ.get("CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser")):
        if candidate and Path(candidate).is_file():
            return candidate
    raise FileNotFoundError(
        "no Chromium found: install Debian's package (apt-get install -y chromium) or set CHROMIUM=/path/to/chromium"
    )


@contextlib.contextmanager
def browser_context(width: int = 1280, height: int = 900) -> Iterator["object"]:
    """A fresh profile in a temporary folder, offline: pages must need nothing from a network."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        raise ImportError('playwright is a development dependency: pip install -e ".[dev]"') from exc
    executable = chromium_path()
    with tempfile.TemporaryDirectory(prefix="blackjack-rl-chromium-") as profile, sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            profile, executable_path=executable, headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": width, "height": height}, offline=True,
        )
        try:
            yield context
        finally:
            context.close()
