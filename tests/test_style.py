"""House rules that a reader relies on: no function in src/ is longer than a screen, except the
few named here with the reason."""

from __future__ import annotations

import ast

from helpers import SRC

MAX_LINES = 80
# (file under src/blackjack_rl, function): why it is longer
ALLOWED = {
    ("api/server.py", "create_app"): "FastAPI's routes are closures over one app's store, settings and pools; "
                                     "split apart, each would take all of them as arguments",
}


def _functions():
    package = SRC / "blackjack_rl"
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path.relative_to(package).as_posix(), node.name, node.end_lineno - node.lineno + 1


def test_no_function_in_src_is_over_80_lines_but_the_allowed():
    long = {(f, name): n for f, name, n in _functions() if n > MAX_LINES}
    assert set(long) <= set(ALLOWED), {k: v for k, v in long.items() if k not in ALLOWED}
    assert len(ALLOWED) <= 3


def test_every_allowed_function_is_still_long():
    """An entry that no longer needs the exception comes off the list."""
    lengths = {(f, name): n for f, name, n in _functions()}
    assert all(lengths.get(key, 0) > MAX_LINES for key in ALLOWED), {k: lengths.get(k) for k in ALLOWED}
