"""A llama-family forward pass in which many rows share one prompt prefix.

Why not just `model(input_ids)`: a GRPO group is one prompt (here ~380 tokens of system
prompt and tool schema) with many short answers (~25-60 tokens). The plain forward runs
the prompt once per row, its KV cache grows by concatenation (copying the whole cache at
every generated token) and it repeats the grouped KV heads for every row. On a 2-core CPU
that is most of the time. Here the prefix runs once, with batch 1, and every row's queries
attend to it by folding the rows into the query dimension, so the prefix keys and values
are never copied per row. Sampling and training both cost O(prefix + rows x suffix), and
gradients flow through the shared prefix exactly as through separate copies.

It can also run a range of layers only, from hidden states instead of token ids. When only
the top layers are trained, the frozen trunk below them computes the same states at sampling
time and at training time, so sampling records them and training runs just the top layers.

It calls the model's own modules (projections, norms, MLP, rotary embedding), so LoRA
adapters injected by peft take part unchanged. The test suite checks its logits against
the model's own forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

try:
    import torch
    import torch.nn.functional as F
except ImportError as exc:  # pragma: no cover - depends on the install
    from blackjack_rl.model import NEEDS_TORCH

    raise ImportError(NEEDS_TORCH) from exc

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def causal_lm(model: Any) -> Any:
    """The `*ForCausalLM` inside a peft wrapper, or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def check_architecture(model: Any) -> None:
    kind = getattr(causal_lm(model).config, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"the trainer's forward pass supports llama-family decoders {SUPPORTED_MODEL_TYPES}, "
            f"not {kind!r}; pick a model of one of those types"
        )


@dataclass
class Prefix:
    """Keys and values of the shared prefix, one [1, kv_heads, P, head_dim] pair per layer
    from `first_layer` up, and the hidden states entering `recorded_layer` when asked."""

    length: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    first_layer: int = 0
    recorded: torch.Tensor | None = None  # [1, P, hidden]
    output: torch.Tensor | None = None  # [1, P, hidden]: what the last layer run produced


@dataclass
class RowCache:
    """Preallocated keys and values of each row's own tokens (written in place, never concatenated)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid: torch.Tensor  # [rows, capacity] bool: real tokens (padding is never attended to)
    length: int = 0

    @classmethod
    def allocate(cls, model: Any, rows: int, capacity: int, dtype: torch.dtype) -> "RowCache":
        cfg = causal_lm(model).config
        kv_heads, head_dim = cfg.num_key_value_heads, _head_dim(cfg)
        shape = (rows, kv_heads, capacity, head_dim)
        n = cfg.num_hidden_layers
        return cls(
            [torch.zeros(shape, dtype=dtype) for _ in range(n)],
            [torch.zeros(shape, dtype=dtype) for _ in range(n)],
            torch.zeros(rows, capacity, dtype=torch.bool),
        )

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop finished rows so later tokens cost nothing for them."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        self.valid = self.valid.index_select(0, rows)


@dataclass
class RowsOutput:
    hidden: torch.Tensor  # [rows, S, hidden]: after the final norm, or entering layer `stop` if it stopped early
    keys: list[torch.Tensor] = field(default_factory=list)  # this call's own keys per layer
    values: list[torch.Tensor] = field(default_factory=list)
    recorded: torch.Tensor | None = None  # hidden states entering `record_layer`


def _head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def run_prefix(
    model: Any,
    inputs: list[int] | torch.Tensor,
    *,
    layers: tuple[int, int | None] = (0, None),
    record_layer: int | None = None,
) -> Prefix | None:
    """The shared prefix, batch 1 (with gradients when grad mode is on): token ids, or
    [P, hidden] states entering `layers[0]`."""
    n = len(inputs)
    if n == 0:
        return None
    x = torch.tensor([inputs]) if not isinstance(inputs, torch.Tensor) else inputs[None]
    out = forward_rows(model, x, torch.arange(n)[None], torch.ones(1, n, dtype=torch.bool),
                       layers=layers, record_layer=record_layer)
    return Prefix(n, out.keys, out.values, layers[0], out.recorded, out.hidden)


def forward_rows(
    model: Any,
    ids: torch.Tensor,
    positions: torch.Tensor,
    key_valid: torch.Tensor,
    prefix: Prefix | None = None,
    cache: RowCache | None = None,
    *,
    layers: tuple[int, int | None] = (0, None),
    record_layer: int | None = None,
    attend: torch.Tensor | None = None,
) -> RowsOutput:
    """Run `ids` [rows, S] (token ids, or hidden states [rows, S, hidden] entering
    `layers[0]`) at `positions` [rows, S] through decoder layers `layers` (start, stop).

    Each token sees the whole prefix, then its own row's earlier tokens (those in `cache`,
    then the new ones, causally) that are marked valid; padding (`key_valid` False) is seen
    by nobody but itself, which keeps its own output finite. With a cache, the new keys and
    values are written into it (the cache spans every layer).

    `attend` [rows, S, S] (no cache) replaces the causal order within a row: which of the row's
    tokens each token sees. Several sequences that share a start then run as one row, the
    start once and each one's own tokens after it (see `logprobs.pack_rows`).
    """
    lm = causal_lm(model)
    core = lm.model
    first, stop = layers[0], layers[1] if layers[1] is not None else len(core.layers)
    rows, s = ids.shape[:2]
    h = ids if ids.is_floating_point() else core.embed_tokens(ids)
    cos, sin = core.rotary_emb(h, positions)
    start = cache.length if cache is not None else 0
    if cache is not None:
        cache.valid[:, start : start + s] = key_valid
        seen = cache.valid[:, : start + s]
    else:
        seen = key_valid
    if attend is not None:
        if cache is not None:
            raise ValueError("`attend` orders a row's own tokens; it cannot be combined with a cache")
        mask = attend & seen[:, None, :]
    else:
        causal = torch.ones(s, start + s, dtype=torch.bool).tril(start)
        mask = causal[None] & seen[:, None, :]
    diag = torch.arange(s)
    mask[:, diag, start + diag] = True
    out = RowsOutput(h)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    for i in range(first, stop):
        if i == record_layer:
            out.recorded = h
        layer = core.layers[i]
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        hd = attn.head_dim
        q = attn.q_proj(x).view(rows, s, -1, hd).transpose(1, 2)
        k = attn.k_proj(x).view(rows, s, -1, hd).transpose(1, 2)
        v = attn.v_proj(x).view(rows, s, -1, hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if cache is not None:
            cache.keys[i][:, :, start : start + s] = k
            cache.values[i][:, :, start : start + s] = v
            k_all, v_all = cache.keys[i][:, :, : start + s], cache.values[i][:, :, : start + s]
        else:
            k_all, v_all = k, v
            out.keys.append(k)
            out.values.append(v)
        pk, pv = (None, None) if prefix is None else (prefix.keys[i - prefix.first_layer], prefix.values[i - prefix.first_layer])
        a = _attend(q, k_all, v_all, mask, pk, pv, getattr(attn, "scaling", hd**-0.5))
        h = h + attn.o_proj(a)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    if cache is not None:
        cache.length = start + s
    out.hidden = core.norm(h) if stop == len(core.layers) else h
    return out


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    pk: torch.Tensor | None,
    pv: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Softmax attention over [prefix keys, own keys], grouped-query heads without repeating keys.

    q [rows, heads, S, d]; k, v [rows, kv_heads, T, d]; mask [rows, S, T];
    pk, pv [1, kv_heads, P, d]. Returns [rows, S, heads * d].
    """
    rows, heads, s, d = q.shape
    kv_heads, t = k.shape[1], k.shape[2]
    g = heads // kv_heads  # query heads per kv head: head h uses kv head h // g
    qg = q.reshape(rows, kv_heads, g * s, d)
    own = (qg @ k.transpose(-1, -2)) * scale  # [rows, kv, g*S, T]
    own = own.view(rows, kv_heads, g, s, t).masked_fill(~mask[:, None, None], float("-inf"))
    own = own.view(rows, kv_heads, g * s, t)
    if pk is None:
        probs = F.softmax(own, dim=-1)
        out = probs @ v
    else:
        p = pk.shape[2]
        # Rows fold into the query dimension: [kv, rows*g*S, d] @ [kv, d, P], no copy of the prefix.
        qp = qg.transpose(0, 1).reshape(kv_heads, rows * g * s, d)
        pre = (qp @ pk[0].transpose(-1, -2)) * scale
        pre = pre.view(kv_heads, rows, g * s, p).transpose(0, 1)
        probs = F.softmax(torch.cat([pre, own], dim=-1), dim=-1)
        pp = probs[..., :p].transpose(0, 1).reshape(kv_heads, rows * g * s, p)
        out = (pp @ pv[0]).view(kv_heads, rows, g * s, d).transpose(0, 1) + probs[..., p:] @ v
    return out.reshape(rows, heads, s, d).transpose(1, 2).reshape(rows, s, heads * d)
