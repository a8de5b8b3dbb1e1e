"""A local tokenizer folder is read without transformers, and gives exactly transformers' ids.

The chat path's start-up was mostly `import transformers` (and torch with it). A folder whose
tokenizer.json transformers loads unchanged is now read with the `tokenizers` library and the
chat template rendered with jinja2 as `apply_chat_template` renders it; these tests hold the two
readings of the same folder to the same text, ids and trajectories.
"""

import asyncio
import json
import shutil
import subprocess
import sys

import pytest

from blackjack_rl.env import opening_messages
from blackjack_rl.rollout.episodes import play_episode
from blackjack_rl.game.table import Rules, Table
from blackjack_rl.policies.bots import RandomBot, ThresholdBot
from blackjack_rl.contract.protocol import HIT, STICK, tool_call_text
from blackjack_rl.contract.tokens import ChatFormat, HFTokenizer

TEXTS = [
    "Hello 12345 world!!  \n\t ünïcödé 🂡",
    "<tool_call>{'a': 1}</tool_call><|im_end|>",
    " leading space",
    "",
    "  \n\n  x",
    "<|im_start|>assistant\n" + tool_call_text(HIT),
    tool_call_text(STICK) + "<|im_end|>\n<|im_start|>user\n",
    "I would like to hit, please. " * 20,
]


@pytest.fixture(scope="module")
def both(hf_tokenizer_dir):
    return HFTokenizer(str(hf_tokenizer_dir)), HFTokenizer(str(hf_tokenizer_dir), via_transformers=True)


def test_encode_and_decode_match_transformers(both):
    fast, exact = both
    for text in TEXTS:
        ids = exact.encode(text)
        assert fast.encode(text) == ids, text
        assert fast.decode(ids) == exact.decode(ids)
    assert fast.eos_token == exact.eos_token == "<|im_end|>"


@pytest.mark.parametrize("thinking", [False, True])
def test_prompts_render_as_transformers_renders_them(both, solution, thinking):
    fast, exact = both
    table = Table(Rules())
    for seed in range(20):
        messages = opening_messages(table.reset(seed), thinking)
        convo = messages + [{"role": "assistant", "content": tool_call_text(HIT)}, {"role": "user", "content": "ok"}]
        for agp in (True, False):
            assert fast.render(convo, agp) == exact.render(convo, agp)
            assert fast.render(messages, agp) == exact.render(messages, agp)


def test_episodes_have_the_same_trajectories(both, solution):
    fast_chat, exact_chat = (ChatFormat.learn(t) for t in both)
    assert (fast_chat.end_of_turn, fast_chat.glue, fast_chat.tail, fast_chat.end_of_turn_ids) == (
        exact_chat.end_of_turn, exact_chat.glue, exact_chat.tail, exact_chat.end_of_turn_ids)
    for policy in (ThresholdBot(19), RandomBot()):
        for seed in range(12):
            a, b = (asyncio.run(play_episode(Table(Rules()), policy, chat, solution, seed))
                    for chat in (fast_chat, exact_chat))
            assert a.messages == b.messages
            assert (a.trajectory.tokens, a.trajectory.masks) == (b.trajectory.tokens, b.trajectory.masks)


def _imports_transformers(folder) -> bool:
    code = ("import sys; from blackjack_rl.contract.tokens import ChatFormat, HFTokenizer; "
            f"ChatFormat.learn(HFTokenizer({str(folder)!r})); print('transformers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip() == "True"


def test_a_verbatim_folder_needs_no_transformers_and_others_still_use_it(hf_tokenizer_dir, tmp_path):
    assert not _imports_transformers(hf_tokenizer_dir)
    # a folder whose decoding transformers would post-process is left to transformers
    other = shutil.copytree(hf_tokenizer_dir, tmp_path / "cleanup")
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "clean_up_tokenization_spaces": True}))
    assert _imports_transformers(other)


def test_the_transformers_tokenizer_is_there_when_asked_even_after_the_folder_is_gone(hf_tokenizer_dir, tmp_path):
    """The trainer asks `.tok` for pad ids and saving; a tokenizer read from a temporary folder still answers."""
    folder = shutil.copytree(hf_tokenizer_dir, tmp_path / "temporary")
    tokenizer = HFTokenizer(str(folder))
    tokenizer.name = "renamed.gguf"  # the trainer renames it after its model file
    shutil.rmtree(folder)
    assert tokenizer.tok.eos_token == "<|im_end|>"
    assert list(tokenizer.tok("Hello 12345", add_special_tokens=False)["input_ids"]) == tokenizer.encode("Hello 12345")


RICH_TEMPLATE = """{%- if tools is not none %}TOOLS{% endif -%}
{%- if documents is defined and documents is none %}NODOCS{% endif -%}
{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}
<{{ m['role'] }}>{{ m['content'] | tojson(indent=2) }}{{ eos_token }}
{% if loop.index > 6 %}{% break %}{% endif %}{% endfor %}
{%- if add_generation_prompt %}<assistant>{% endif %}"""


def test_template_features_render_as_in_transformers(hf_tokenizer_dir, tmp_path):
    """A template using `tools is not none`, loop controls, tojson with indent and the special tokens."""
    folder = shutil.copytree(hf_tokenizer_dir, tmp_path / "rich")
    (folder / "chat_template.jinja").write_text(RICH_TEMPLATE)
    fast, exact = HFTokenizer(str(folder)), HFTokenizer(str(folder), via_transformers=True)
    messages = [{"role": "system", "content": "s"}] + [
        {"role": "user" if i % 2 else "assistant", "content": f"turn {i} ünï \"q\" <b>"} for i in range(9)]
    for agp in (True, False):
        assert fast.render(messages, agp) == exact.render(messages, agp)
