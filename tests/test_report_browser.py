"""The generated pages, opened in a real headless Chromium (Debian's `chromium`, driven by playwright).

Each page must open from file:// with no network, log no console error, and show the
numbers the run wrote to its JSON files.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from blackjack_rl.config import GroupConfig
from blackjack_rl.rollout.episodes import EpisodeSettings
from blackjack_rl.rollout.groups import play_group
from blackjack_rl.rollout.players import Player
from blackjack_rl.policies.base import Reply
from blackjack_rl.policies.bots import RandomBot
from blackjack_rl.report.chromium import browser_context
from blackjack_rl.report.dataset import DatasetView
from helpers import CLI, run_cli

pytestmark = pytest.mark.slow  # Chromium, and a 10,000-group dataset


def cli(*args):
    return run_cli(*args, "--quiet", check=True)


@pytest.fixture(scope="module")
def browser():
    with browser_context() as context:
        yield context


class Opened:
    """A page with everything it logged and every request it made."""

    def __init__(self, context, path: Path, ready: str | None = None) -> None:
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page = context.new_page()
        self.page.set_default_timeout(15_000)
        self.page.on("console", lambda m: self.errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.goto(path.resolve().as_uri())
        if ready:
            self.page.wait_for_selector(ready, state="attached", timeout=30_000)

    def assert_clean(self) -> None:
        assert self.errors == []
        remote = [u for u in self.requests if not u.startswith(("file:", "data:", "about:"))]
        assert remote == [], "the page must be self-contained"

    def close(self) -> None:
        self.page.close()


def _lookup(metrics, dotted):
    value = metrics if isinstance(metrics, dict) else metrics.to_json()
    for part in dotted.split("."):
        value = value[part]
    return value


def assert_numbers_match(opened: Opened, metrics: dict) -> int:
    """Every number marked data-metric shows the value metrics.json holds, at its shown precision."""
    shown = opened.page.eval_on_selector_all("[data-metric]", "els => els.map(e => [e.dataset.metric, e.innerText])")
    assert shown
    for key, text in shown:
        expected = _lookup(metrics, key)
        text = text.strip()
        if text.endswith("%"):
            decimals = len(text[:-1].split(".")[1]) if "." in text else 0
            assert float(text[:-1]) / 100 == pytest.approx(expected, abs=0.5 * 10 ** -(decimals + 2) + 1e-12), key
        elif isinstance(expected, int):
            assert int(text) == expected, key
        else:
            decimals = len(text.split(".")[1])
            assert float(text) == pytest.approx(expected, abs=0.5 * 10 ** -decimals + 1e-12), key
    return len(shown)


# --- the evaluation report -----------------------------------------------------------------

@pytest.fixture(scope="module")
def threshold_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("threshold")
    cli("evaluate", "--policy", "threshold", "--threshold", "17", "--episodes", "1500", "--out", str(out))
    return out


def test_report_chart_has_one_cell_per_state_matching_the_samples(browser, threshold_run):
    metrics = json.loads((threshold_run / "metrics.json").read_text())
    rows = [json.loads(line) for line in (threshold_run / "samples.jsonl").read_text().splitlines()]
    page = Opened(browser, threshold_run / "report.html")
    try:
        page.assert_clean()
        cells = page.page.eval_on_selector_all(
            "table.strategy td.cell",
            "els => els.map(e => [e.closest('table').dataset.kind, e.dataset.state, Number(e.dataset.n), "
            "e.dataset.hitRate, e.dataset.optimal, e.classList.contains('disagree')])")
        assert sum(kind == "hard" for kind, *_ in cells) == 18 * 10
        assert sum(kind == "soft" for kind, *_ in cells) == 10 * 10
        by_state = {c[1]: c for c in cells}
        assert len(by_state) == 280
        expected_states = {f"hard-{s}-{'A' if d == 1 else d}" for s in range(4, 22) for d in range(1, 11)}
        expected_states |= {f"soft-{s}-{'A' if d == 1 else d}" for s in range(12, 22) for d in range(1, 11)}
        assert set(by_state) == expected_states

        counts = defaultdict(lambda: [0, 0])
        for row in rows:
            for d in row["decisions"]:
                s, dealer, ace = d["state"]
                key = f"{'soft' if ace else 'hard'}-{s}-{'A' if dealer == 1 else dealer}"
                counts[key][0] += 1
                counts[key][1] += d["action"] == "hit"
        for key, (_, _, n, hit_rate, _, _) in by_state.items():
            assert n == counts[key][0], key
            if n:
                assert float(hit_rate) == pytest.approx(counts[key][1] / n), key
            else:
                assert hit_rate == ""
        # the bot hits hard 16 against a 2, where the optimal play sticks; against a 10 both hit
        assert by_state["hard-16-2"][4] == "stick" and by_state["hard-16-2"][5]
        assert by_state["hard-16-10"][4] == "hit" and not by_state["hard-16-10"][5]
        heat = page.page.eval_on_selector_all("table.heat td.cell", "els => els.length")
        assert heat == 2 * 280  # accuracy and cost maps, one cell per state each

        assert assert_numbers_match(page, metrics) >= 15
        assert page.page.get_attribute("#mode", "data-mode") == "scripted"
        assert "threshold-17" in page.page.inner_text("h1")
    finally:
        page.close()


def test_report_episode_browser_shows_decisions_against_the_optimum(browser, threshold_run):
    page = Opened(browser, threshold_run / "report.html")
    try:
        page.page.select_option("#epfilter", "mistake")
        items = page.page.locator("#eplist .item")
        assert items.count() > 0
        items.first.click()
        detail = page.page.inner_text("#epdetail")
        assert "✗" in detail and "Conversation" in detail and "take_action" in detail
        page.page.click("#epnext")
        assert re.search(r"page 2 of \d+", page.page.inner_text("#eppage"))
        page.assert_clean()
    finally:
        page.close()


def test_report_lists_invalid_answers_by_reason_with_real_examples(browser, tmp_path, vocab_chat, solution):
    from blackjack_rl.measure.evaluation import compute_metrics
    from blackjack_rl.rollout.runner import run_evaluation
    from blackjack_rl.report.evaluation import write_report

    player = Player(SometimesWrong(), vocab_chat, solution, EpisodeSettings())
    with ThreadPoolExecutor(1) as pool:  # playwright owns this thread's event loop
        episodes = pool.submit(asyncio.run, run_evaluation(player, 300, 16)).result()
    metrics = compute_metrics(episodes, player)
    assert metrics.invalid_by_reason["no_call"].count > 0
    write_report(tmp_path / "report.html", metrics, [ep.sample_row() for ep in episodes], solution)
    page = Opened(browser, tmp_path / "report.html")
    try:
        page.assert_clean()
        assert_numbers_match(page, metrics)
        examples = page.page.inner_text(".examples")
        assert "no_call" in examples and "I would like to hit, please." in examples
        page.page.select_option("#epfilter", "reason:no_call")
        page.page.locator("#eplist .item").first.click()
        assert "invalid" in page.page.inner_text("#epdetail")
    finally:
        page.close()


EVIL = "</script><script>window.pwned = 1</script> <!-- <script> x \u2028 y \u2029 z \ud800 & &amp; ' \" \\"


class SaysAnything(RandomBot):
    """A random player whose every answer carries text that would break a naive page."""

    async def respond(self, turn):
        reply = await super().respond(turn)
        return Reply(text=EVIL.replace("\ud800", "") + reply.text)


def test_report_episode_browser_shows_any_answer_text(browser, tmp_path, vocab_chat, solution):
    """`<!--` in an answer once hid every episode (the escaping made invalid JSON); `</script>`,
    line separators and lone surrogates are the rest of that class."""
    from blackjack_rl.measure.evaluation import compute_metrics
    from blackjack_rl.rollout.runner import run_evaluation
    from blackjack_rl.report.evaluation import write_report

    player = Player(SaysAnything(), vocab_chat, solution, EpisodeSettings())
    with ThreadPoolExecutor(1) as pool:  # playwright owns this thread's event loop
        episodes = pool.submit(asyncio.run, run_evaluation(player, 30, 8)).result()
    rows = [ep.sample_row() for ep in episodes]
    for row in rows:  # a lone surrogate cannot be tokenized, but may arrive in the text of a row
        row.messages[-1]["content"] = EVIL + row.messages[-1]["content"]
    write_report(tmp_path / "report.html", compute_metrics(episodes, player), rows, solution)
    page = Opened(browser, tmp_path / "report.html")
    try:
        page.assert_clean()
        assert page.page.evaluate("window.pwned") is None
        assert page.page.locator("#eplist .item").count() == 30
        assert page.page.locator("#eplist .item").first.get_attribute("data-seed") == str(rows[0].seed)
        shown = page.page.inner_text("#epdetail")
        assert "</script><script>window.pwned = 1</script> <!-- <script> x" in shown and "take_action" in shown
        answers = page.page.evaluate(
            "JSON.parse(document.getElementById('episodes-data').textContent).episodes.map(e => e.messages.at(-1)[1])")
        assert answers == [row.messages[-1]["content"] for row in rows]
    finally:
        page.close()


# --- the comparison page ---------------------------------------------------------------------

def test_compare_page_opens_clean_and_shows_the_paired_verdict(browser, threshold_run, tmp_path):
    cli("evaluate", "--policy", "optimal", "--episodes", "1500", "--out", str(tmp_path / "optimal"))
    proc = subprocess.run([*CLI, "compare", str(tmp_path / "optimal"), str(threshold_run), "--out", str(tmp_path / "cmp")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    page = Opened(browser, tmp_path / "cmp" / "compare.html")
    try:
        page.assert_clean()
        rows = page.page.eval_on_selector_all("section.comparison tr[data-quantity]",
                                              "els => els.map(e => [e.dataset.quantity, Number(e.dataset.mean)])")
        shown = dict(rows)
        for key, diff in data["comparisons"][0]["differences"].items():
            assert shown[key] == pytest.approx(diff["mean"], abs=1e-6)
        assert shown["expected"] < 0
        assert page.page.locator("#runs tr[data-run]").count() == 2
    finally:
        page.close()


# --- the dataset viewer ------------------------------------------------------------------------

class SometimesWrong(RandomBot):
    """A random player that now and then answers without a call, so groups carry invalid reasons."""

    async def respond(self, turn):
        if turn.seed % 5 == 0:
            return Reply(text="I would like to hit, please.")
        return await super().respond(turn)


@pytest.fixture(scope="module")
def big_dataset(tmp_path_factory, vocab_chat, solution):
    """10,000 groups: 40 deals really played and packed, each written 250 times under new seeds."""
    player = Player(SometimesWrong(), vocab_chat, solution, EpisodeSettings())

    async def play():
        return [await play_group(player, seed, GroupConfig(group_size=2)) for seed in range(40)]

    # playwright's sync API owns this thread's event loop, so the games run on another thread
    with ThreadPoolExecutor(1) as pool:
        played = [r.group for r in pool.submit(asyncio.run, play()).result()]
    out = tmp_path_factory.mktemp("viewer")
    expected = {"no_call": 0, "mixed": 0}
    with DatasetView(out / "groups.html", vocab_chat.backend) as view:
        for i in range(10_000):
            source = played[i % 40]
            group = source.model_copy(update={"episodes": [ep.model_copy(update={"seed": 1_000_000 + i})
                                                           for ep in source.episodes]})
            view.add(group)
            expected["no_call"] += any(ep.invalid_reason == "no_call" for ep in group.episodes)
            expected["mixed"] += len(set(group.scores)) > 1
    assert 0 < expected["no_call"] < 10_000 and 0 < expected["mixed"] < 10_000
    return out, played, expected


def _page_info(opened):
    return opened.page.inner_text("#pageinfo")


def test_viewer_pages_through_ten_thousand_groups(browser, big_dataset):
    out, played, expected = big_dataset
    page = Opened(browser, out / "groups.html", ready="body[data-ready]")
    try:
        p = page.page
        assert p.get_attribute("#status", "data-groups") == "10000"
        assert _page_info(page).startswith("groups 1–10 of 10000")
        assert p.locator("#groups .group").count() == 10
        p.click("#last")
        p.wait_for_function("document.getElementById('pageinfo').innerText.startsWith('groups 9991')")
        p.wait_for_selector('.group[data-index="9999"]')
        p.fill("#goto", "500")
        p.dispatch_event("#goto", "change")
        p.wait_for_selector('.group[data-index="4990"]')
        assert p.locator(".group").first.get_attribute("data-seed") == str(1_000_000 + 4990)
        p.evaluate("document.activeElement.blur()")  # arrows page only when no field has the focus
        p.keyboard.press("ArrowRight")
        p.wait_for_selector('.group[data-index="5000"]')

        p.fill("#f-seed", "1009999")
        p.wait_for_function("document.getElementById('pageinfo').innerText.startsWith('groups 1–1 of 1 ')")
        p.wait_for_selector('.group[data-index="9999"]')
        p.fill("#f-seed", "")
        p.select_option("#f-reason", "no_call")
        p.wait_for_function(f"document.getElementById('pageinfo').innerText.includes('of {expected['no_call']} ')")
        for badge in p.locator(".group").all():
            assert "no_call" in badge.inner_text()
        p.select_option("#f-reason", "")
        p.select_option("#f-scores", "mixed")
        p.wait_for_function(f"document.getElementById('pageinfo').innerText.includes('of {expected['mixed']} ')")
        p.select_option("#f-scores", "all")
        p.fill("#f-min", "1")
        p.dispatch_event("#f-min", "change")
        p.wait_for_function("!document.getElementById('pageinfo').innerText.includes('of 10000 ')")
        for group in p.locator(".group").all()[:3]:
            scores = [float(x) for x in re.search(r"scores \[([^\]]*)\]", group.inner_text()).group(1).split(",")]
            assert sum(scores) / len(scores) >= 1
        page.assert_clean()
    finally:
        page.close()


def test_viewer_highlights_the_trained_tokens(browser, big_dataset):
    out, played, _ = big_dataset
    page = Opened(browser, out / "groups.html", ready="body[data-ready]")
    try:
        p = page.page
        first = p.locator('.group[data-index="0"] details.tokens').first
        first.locator("summary").click()
        p.wait_for_selector('.group[data-index="0"] details.tokens .tok span')
        masks = played[0].masks[0]
        tokens = played[0].tokens[0]
        assert first.locator(".tok span.t").count() == sum(m != -100 for m in masks)
        assert first.locator(".tok span.t, .tok span.c").count() == len(tokens)
        text = "".join(first.locator(".tok").inner_text().split())
        assert "take_action" in text and "<|im_start|>" in text
        page.assert_clean()
    finally:
        page.close()


def test_viewer_written_by_process_opens_clean(browser, tmp_path):
    cli("process", "--policy", "random", "--groups", "12", "--group-size", "3", "--out", str(tmp_path))
    lines = (tmp_path / "groups.jsonl").read_text().splitlines()
    page = Opened(browser, tmp_path / "groups.html", ready="body[data-ready]")
    try:
        assert page.page.get_attribute("#status", "data-groups") == str(len(lines))
        seed = json.loads(lines[0])["episodes"][0]["seed"]
        assert page.page.locator(".group").first.get_attribute("data-seed") == str(seed)
        page.assert_clean()
    finally:
        page.close()
