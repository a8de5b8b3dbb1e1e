"""What every page shares: the template environment, number formats, colours, JSON for scripts."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import Environment, FileSystemBytecodeCache, PackageLoader, select_autoescape
from jinja2.bccache import Bucket


class _CompiledTemplates(FileSystemBytecodeCache):
    """jinja2's cache of compiled templates in a private per-user temp directory (compiling the
    report costs a short command ~50 ms), which can never fail a page: a directory that cannot
    be read or written only means compiling again.

    jinja2 recompiles when a template's text changes, but its key leaves out the environment's
    options (autoescaping is compiled in), so the file names carry a hash of jinja2's version
    and of this module, where the options are set.
    """

    def __init__(self) -> None:
        key = hashlib.blake2b(jinja2.__version__.encode() + Path(__file__).read_bytes(), digest_size=8).hexdigest()
        super().__init__(pattern=f"__blackjack_rl_{key}_%s.cache")

    def load_bytecode(self, bucket: Bucket) -> None:
        try:
            super().load_bytecode(bucket)
        except OSError:
            bucket.reset()

    def dump_bytecode(self, bucket: Bucket) -> None:
        with contextlib.suppress(OSError):
            super().dump_bytecode(bucket)


def _template_cache() -> _CompiledTemplates | None:
    try:
        return _CompiledTemplates()
    except (OSError, RuntimeError):  # no usable temp directory, or one another user owns
        return None


def environment() -> Environment:
    env = Environment(loader=PackageLoader("blackjack_rl", "report/templates"),
                      autoescape=select_autoescape(default=True, default_for_string=True),
                      bytecode_cache=_template_cache())
    env.filters.update(pct=pct, signed=signed, num=num, script_json=script_json)
    return env


def pct(v: float | None, digits: int = 1) -> str:
    return "–" if v is None else f"{v * 100:.{digits}f}%"


def signed(v: float | None, digits: int = 4) -> str:
    return "–" if v is None else f"{v:+.{digits}f}"


def num(v: float | None, digits: int = 4) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


# In JSON text these characters occur only inside strings, where \uXXXX means the same
# character; escaped, no answer can close the <script> element (`</script>`), open an
# HTML comment in it (`<!--`, which hides the rest of the script from the parser), or
# end a line in older JavaScript (U+2028, U+2029, escaped by ensure_ascii like every
# non-ASCII character and every lone surrogate).
_SCRIPT_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"})


def script_json(value: Any) -> str:
    """JSON that is the same value inside <script type="application/json">, in a <script>, or in a
    .js file: ASCII only, no `<`, `>` or `&`, no NaN."""
    text = json.dumps(value, separators=(",", ":"), allow_nan=False, ensure_ascii=True, default=_plain)
    return text.translate(_SCRIPT_ESCAPES)


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


def mix(c1: str, c2: str, t: float) -> str:
    """Linear blend of two #rrggbb colours, t in [0, 1]."""
    t = min(1.0, max(0.0, t))
    a = [int(c1[i:i + 2], 16) for i in (1, 3, 5)]
    b = [int(c2[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(x + (y - x) * t):02x}" for x, y in zip(a, b))


STICK_COLOUR, HIT_COLOUR, NEUTRAL = "#81c784", "#e57373", "#f5f5f5"


def hit_colour(hit_rate: float | None) -> str:
    """Green when the model sticks, red when it hits, pale in between."""
    if hit_rate is None:
        return "#ffffff"
    if hit_rate < 0.5:
        return mix(STICK_COLOUR, NEUTRAL, hit_rate * 2)
    return mix(NEUTRAL, HIT_COLOUR, (hit_rate - 0.5) * 2)


def accuracy_colour(acc: float | None) -> str:
    if acc is None:
        return "#ffffff"
    return mix("#e53935", "#c8e6c9", acc) if acc < 1 else "#a5d6a7"


def cost_colour(cost: float, worst: float) -> str:
    if worst <= 0 or cost <= 0:
        return "#fafafa"
    return mix("#fff3e0", "#b71c1c", math.sqrt(cost / worst))
