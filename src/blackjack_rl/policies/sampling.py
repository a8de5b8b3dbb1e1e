"""How answers are sampled: one record that every policy takes, so a setting is declared once
and `make_policy` can tell which policy honours which setting."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # 1: off
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    max_tokens: int = 64  # new tokens per model turn
    extra: dict[str, Any] = field(default_factory=dict)  # servers: merged into every request body

    @property
    def truncates(self) -> bool:
        """Whether top-p, top-k or min-p cut the distribution (each is off at its default)."""
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0
