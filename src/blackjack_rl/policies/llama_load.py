"""Loading llama.cpp models with the weights in plain CPU buffers.

Why: on CPUs with AMX (Intel Sapphire Rapids and later) ggml moves quantized weights into AMX
buffers, and its AMX matrix multiply segfaults on some such machines and VMs at the first
decode (llama.cpp issue 20824, closed unfixed; a build made on the machine itself enables AMX).
Plain buffers keep ggml's ordinary CPU kernels, the ones every number in this project was
measured with (ggml has no repacked x86 kernels for Q4_1, the embedded model's weights).
`Llama` has no argument for this, so its default model parameters are swapped while it
loads; that touches llama-cpp-python's module layout, which is why it is pinned.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_LOCK = threading.Lock()


@contextmanager
def plain_cpu_buffers() -> Iterator[None]:
    """Models loaded inside get no extra (AMX or repacked) weight buffers."""
    import llama_cpp
    from llama_cpp import llama as high_level

    defaults = llama_cpp.llama_model_default_params

    def params() -> Any:
        p = defaults()
        p.use_extra_bufts = False
        return p

    with _LOCK:
        high_level.llama_cpp.llama_model_default_params = params
        try:
            yield
        finally:
            high_level.llama_cpp.llama_model_default_params = defaults


def load_llama(**kwargs: Any) -> Any:
    """`llama_cpp.Llama(**kwargs)`, in plain CPU buffers."""
    from llama_cpp import Llama

    with plain_cpu_buffers():
        return Llama(**kwargs)
