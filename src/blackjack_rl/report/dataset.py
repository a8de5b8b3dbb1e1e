"""A self-contained HTML view of a `process` dataset (groups.jsonl).

The page carries its data as JSON and renders one page of groups at a time in the
browser, so it opens instantly however many groups the file holds. Token-level
views (trained positions highlighted) are embedded for the first groups only,
since they multiply the size of the page.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape

from ..tokens import MASKED

TOKEN_VIEW_GROUPS = 200


def _environment() -> Environment:
    return Environment(loader=PackageLoader("blackjack_rl", "report/templates"), autoescape=select_autoescape())


def _group_row(i: int, group: dict[str, Any], tokenizer: Any | None) -> dict[str, Any]:
    seqs = []
    for j, tokens in enumerate(group["tokens"]):
        masks = group["masks"][j]
        logprobs = (group.get("inference_logprobs") or [None] * len(group["tokens"]))[j]
        seq: dict[str, Any] = {
            "score": group["scores"][j],
            "messages": (group.get("messages") or [[]] * len(group["tokens"]))[j],
            "n_tokens": len(tokens),
            "n_trained": sum(m != MASKED for m in masks),
        }
        if tokenizer is not None:
            seq["pieces"] = [
                [tokenizer.decode([t]), int(m != MASKED), None if logprobs is None or m == MASKED else round(logprobs[k], 3)]
                for k, (t, m) in enumerate(zip(tokens, masks))
            ]
        seqs.append(seq)
    episodes = group.get("episodes") or [{}] * len(seqs)
    return {
        "index": i,
        "seed": episodes[0].get("seed") if episodes else None,
        "scores": group["scores"],
        "episodes": episodes,
        "sequences": seqs,
    }


def write_dataset_view(jsonl: Path, html: Path, tokenizer: Any | None = None) -> Path:
    rows = []
    with jsonl.open(encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            if line.strip():
                rows.append(_group_row(i, json.loads(line), tokenizer if i < TOKEN_VIEW_GROUPS else None))
    params = {}
    if rows:
        with jsonl.open(encoding="utf-8") as fh:
            params = json.loads(fh.readline()).get("generation_params") or {}
    page = _environment().get_template("dataset.html.jinja").render(
        title=f"blackjack-rl dataset: {jsonl.name}",
        source=jsonl.name,
        n_groups=len(rows),
        params=params,
        data=json.dumps(rows).replace("</", "<\\/"),
        token_view_groups=TOKEN_VIEW_GROUPS,
    )
    html.write_text(page, encoding="utf-8")
    return html
