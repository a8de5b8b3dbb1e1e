"""Build a Hugging Face tokenizer folder from a GGUF's own vocabulary, without torch or a hub.

Hub downloads are impossible in CI, and `AutoTokenizer.from_pretrained(gguf_file=...)`
imports torch; this rebuilds SmolLM2's byte-level BPE from the GGUF metadata with the
`tokenizers` library so the server path (`HFTokenizer`) can be tested on the
embedded model. Tests check it yields exactly llama.cpp's ids.
"""

from __future__ import annotations

from pathlib import Path


def build_hf_tokenizer(gguf_path: Path, out_dir: Path) -> Path:
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    reader = gguf.GGUFReader(str(gguf_path))
    field = lambda name: reader.fields[name].contents()  # noqa: E731
    tokens: list[str] = field("tokenizer.ggml.tokens")
    types: list[int] = field("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    tok = Tokenizer(bpe)
    # llama.cpp's "smollm" pre-tokenizer: digits one by one, then GPT-2's byte-level split.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in (3, 4)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=tokens[int(field("tokenizer.ggml.eos_token_id"))],
        bos_token=tokens[int(field("tokenizer.ggml.bos_token_id"))],
        unk_token=tokens[int(field("tokenizer.ggml.unknown_token_id"))],
        pad_token=tokens[int(field("tokenizer.ggml.padding_token_id"))],
        chat_template=field("tokenizer.chat_template"),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return out_dir
