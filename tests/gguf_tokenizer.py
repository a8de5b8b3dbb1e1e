"""The test tokenizer builder under the name that `bench/` scripts import; it lives in tests/helpers.py."""

from helpers import build_hf_tokenizer

__all__ = ["build_hf_tokenizer"]
