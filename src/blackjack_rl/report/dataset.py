"""The dataset viewer for `process` output, built incrementally as groups arrive.

Layout (all relative, so the folder can be moved or zipped):

    groups.html                 the page: styles and code only, written once
    groups-view/manifest.js     totals and the number of chunks, rewritten after every chunk
    groups-view/index-0000.js   one short summary row per group (seed, scores, invalid reasons)
    groups-view/chunk-0000.js   the groups themselves: messages, tokens, masks, logprobs

Browsers refuse fetch() on file:// pages, but they do run <script src> files, so every
data file is a script that hands its payload to the page. The page loads the small
index files to filter and paginate across all groups, and loads a chunk only when one
of its groups is shown: 10,000 groups open as fast as 10. Each chunk is written when
it fills (or every few seconds while it fills, for slow models) and never again, so a
run costs O(groups), never a rewrite of everything written so far.

Tokens are stored compactly: every sequence of a chunk shares most of its prompt (the
system prompt), so a sequence keeps the length of its common prefix with the chunk's
first sequence plus its own remainder; masks become trained spans; logprobs are kept
for trained positions only (masked positions carry 1.0 by convention).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from blackjack_rl.outputs import write_text
from blackjack_rl.contract.records import EpisodeRecord, ScoredDataGroup, SequenceRecord, StepRecord
from blackjack_rl.contract.tokens import MASKED
from blackjack_rl.report.html import environment, script_json

CHUNK_GROUPS = 200
FLUSH_SECONDS = 5.0


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix, by binary search over slice comparisons (C speed)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def trained_spans(masks: list[int]) -> list[list[int]]:
    spans: list[list[int]] = []
    start = None
    for i, m in enumerate(masks):
        if m != MASKED and start is None:
            start = i
        elif m == MASKED and start is not None:
            spans.append([start, i])
            start = None
    if start is not None:
        spans.append([start, len(masks)])
    return spans


def group_summary(group: ScoredDataGroup) -> list[Any]:
    """[seed, scores, invalid reasons ("|"-joined), sequences, longest sequence]: what filters need."""
    episodes = group.episodes
    seed = episodes[0].seed if episodes else None
    reasons = sorted({str(ep.invalid_reason) for ep in episodes if ep.invalid_reason})
    return [seed, [round(float(s), 4) for s in group.scores], "|".join(reasons),
            len(group.tokens), max((len(t) for t in group.tokens), default=0)]


# What a sequence's card shows, by the kind of record (a step group's: its one decision).
_SHOWN: dict[type, tuple[str, ...]] = {
    EpisodeRecord: ("status", "outcome", "reward", "invalid_reason", "actions", "optimal_actions", "player_hand",
                    "dealer_hand", "regret"),
    StepRecord: ("invalid_reason", "decision", "state", "action", "optimal"),
}


def _episode_meta(record: SequenceRecord) -> dict[str, Any]:
    data = record.to_json()
    return {k: data[k] for k in _SHOWN[type(record)] if data[k] is not None}


class _Chunk:
    """Groups of one chunk, packed as they arrive."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.base: list[int] | None = None
        self.ids: set[int] = set()
        self.systems: list[str] = []
        self.groups: list[dict[str, Any]] = []
        self.index: list[list[Any]] = []

    def add(self, position: int, group: ScoredDataGroup) -> None:
        tokens_all = group.tokens
        masks_all = group.masks
        logprobs_all = group.inference_logprobs or [None] * len(tokens_all)
        messages_all = group.messages or [[] for _ in tokens_all]
        episodes = group.episodes
        seqs = []
        for j, tokens in enumerate(tokens_all):
            tokens = list(tokens)
            if self.base is None:
                self.base = tokens
                self.ids.update(tokens)
            lcp = common_prefix(self.base, tokens)
            rest = tokens[lcp:]
            self.ids.update(rest)
            masks = masks_all[j] if j < len(masks_all) else [MASKED] * len(tokens)
            spans = trained_spans(masks)
            lps = logprobs_all[j] if j < len(logprobs_all) else None
            trained_lp = [round(float(lps[k]), 3) for a, b in spans for k in range(a, b)] if lps else []
            msgs = []
            for m in messages_all[j] if j < len(messages_all) else []:
                content = m.get("content", "")
                if m.get("role") == "system":
                    if content not in self.systems:
                        self.systems.append(content)
                    msgs.append(["system", self.systems.index(content)])
                else:
                    msgs.append([m.get("role", "?"), content])
            seqs.append({
                "score": (group.scores or [None] * len(tokens_all))[j],
                "n": len(tokens), "lcp": lcp, "rest": rest, "spans": spans, "lp": trained_lp, "msgs": msgs,
                "ep": _episode_meta(episodes[j]) if j < len(episodes) else {},
            })
        self.groups.append({"i": position, "seqs": seqs, "params": group.generation_params,
                            "overrides": group.group_overrides})
        self.index.append(group_summary(group))


class DatasetView:
    """Writes the viewer next to the JSONL as groups are written.

    `tokenizer` (anything with `decode([id]) -> str`) turns ids into readable pieces; without
    one the page shows ids.
    """

    def __init__(self, html_path: Path, tokenizer: Any | None = None, *, source: str = "groups.jsonl",
                 chunk_groups: int = CHUNK_GROUPS, flush_seconds: float = FLUSH_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if chunk_groups < 1:
            raise ValueError("chunk_groups must be at least 1")
        self.html_path = Path(html_path)
        self.data_dir = self.html_path.with_name(self.html_path.stem + "-view")
        self.tokenizer = tokenizer
        self.source = source
        self.chunk_groups = chunk_groups
        self.flush_seconds = flush_seconds
        self._clock = clock
        self._pieces: dict[int, str] = {}
        self._chunk = _Chunk(0)
        self._chunks_done = 0
        self._groups = 0
        self._reasons: set[str] = set()
        self._params: dict[str, Any] | None = None
        self._last_flush = clock()
        self._closed = False
        if self.data_dir.exists():  # a new run replaces the previous one's data
            shutil.rmtree(self.data_dir)
        self.data_dir.mkdir(parents=True)
        self.html_path.parent.mkdir(parents=True, exist_ok=True)
        self._write_manifest(complete=False)
        page = environment().get_template("viewer.html.jinja").render(
            title=f"blackjack-rl dataset: {source}", data_dir=self.data_dir.name)
        write_text(self.html_path, page)

    # -- feeding --------------------------------------------------------------------------

    def add(self, group: ScoredDataGroup) -> None:
        if self._closed:
            raise RuntimeError("the dataset view is closed; open a new DatasetView to write another run")
        if self._params is None:
            self._params = group.generation_params or {}
        for ep in group.episodes:
            if ep.invalid_reason:
                self._reasons.add(str(ep.invalid_reason))
        self._chunk.add(self._groups, group)
        self._groups += 1
        if len(self._chunk.groups) >= self.chunk_groups:
            self._write_chunk(self._chunk)
            self._chunks_done += 1
            self._chunk = _Chunk(self._chunks_done)
            self._write_manifest(complete=False)
            self._last_flush = self._clock()
        elif self._clock() - self._last_flush >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Show the groups of the unfinished chunk too (rewrites that one chunk only)."""
        if self._chunk.groups:
            self._write_chunk(self._chunk)
        self._write_manifest(complete=self._closed)
        self._last_flush = self._clock()

    def close(self) -> Path:
        if not self._closed:
            self._closed = True
            self.flush()
        return self.html_path

    def __enter__(self) -> "DatasetView":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- files ----------------------------------------------------------------------------

    def _piece(self, token: int) -> str:
        piece = self._pieces.get(token)
        if piece is None:
            try:
                piece = self.tokenizer.decode([token])
            except Exception:  # noqa: BLE001 - an undecodable id is shown as its number
                piece = f"<{token}>"
            self._pieces[token] = piece
        return piece

    def _write_chunk(self, chunk: _Chunk) -> None:
        pieces = {str(t): self._piece(t) for t in sorted(chunk.ids)} if self.tokenizer is not None else None
        payload = {"base": chunk.base or [], "pieces": pieces, "systems": chunk.systems, "groups": chunk.groups}
        self._write_js(f"chunk-{chunk.number:04d}.js", f"VIEW.chunk({chunk.number},", payload)
        self._write_js(f"index-{chunk.number:04d}.js", f"VIEW.index({chunk.number},", chunk.index)

    def _write_manifest(self, complete: bool) -> None:
        partial = 1 if self._chunk.groups else 0
        manifest = {
            "chunks": self._chunks_done + partial,
            "groups": self._groups,
            "chunk_groups": self.chunk_groups,
            "complete": complete,
            "source": self.source,
            "params": self._params or {},
            "reasons": sorted(self._reasons),
            "tokens": self.tokenizer is not None,
            "updated": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        self._write_js("manifest.js", "VIEW.manifest(", manifest)

    def _write_js(self, name: str, call: str, payload: Any) -> None:
        # whole or absent: a page opened mid-run never reads half a file
        write_text(self.data_dir / name, f"{call}{script_json(payload)});\n")


def write_dataset_view(jsonl: Path, html: Path, tokenizer: Any | None = None, **kwargs: Any) -> Path:
    """Build the viewer for an existing groups.jsonl, streaming it once."""
    with Path(jsonl).open(encoding="utf-8") as fh, DatasetView(html, tokenizer, source=Path(jsonl).name, **kwargs) as view:
        for line in fh:
            if line.strip():
                view.add(ScoredDataGroup.from_json(json.loads(line)))
    return Path(html)

