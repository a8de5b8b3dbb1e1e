"""A LoRA folded into the embedded GGUF (policies/gguf_fold.py) is the adapter llama.cpp applies.

Readings: the per-token logprobs of the two valid calls after the real opening prompt of chart
states, and P(hit | valid call), as measure/probe.py reads a policy's strategy.

Two comparisons, because llama.cpp's Q4_1 kernels round the activations to 8 bits and F16 ones do
not: re-encoding the base's six adapted layers as F16, with no adapter at all, already moves
P(hit | valid) by up to 0.12 on these states. So the fold is checked exactly against llama.cpp
applying the adapter to that same re-encoded base (same kernels, only the order of the sums
differs), and against the shipped path (Q4_1 base + adapter) at the base's own kernel noise.
Wrong folds (no update, no rotary row order, a scale ignored) fail the exact comparison by far.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from blackjack_rl import trained
from blackjack_rl.contract.protocol import HIT, STICK, tool_call_text
from blackjack_rl.game.solver import GRID_STATES
from blackjack_rl.game.table import Observation
from blackjack_rl.policies import gguf_lora
from blackjack_rl.policies.gguf_fold import FIELD, fold_cache_path, fold_lora_gguf, folded_gguf
from blackjack_rl.rollout.credit import hit_share
from blackjack_rl.rollout.episodes import opening_messages

pytestmark = [pytest.mark.embedded, pytest.mark.timeout(1200)]
gguf = pytest.importorskip("gguf")

STATES = GRID_STATES[::14]  # 20 chart states
FEW = slice(None, None, 4)  # 5 of them, for the wrong folds
# Same kernels (measured on Intel: 0.073 nats, 1.9e-3; an f32 fold 0.022 and 6e-4). The largest
# logprob gaps are at the action token where its logprob is around -5. Its logits come from the
# token before it decoded alone (embedded.score_answers), the kernel that differs most on AVX2:
# there 0.030 nats and 1.3e-3, the half-alpha copy 0.024 and 6.4e-3; wrong folds 0.35 and more.
EXACT_LOGPROB, EXACT_P = 0.15, 1e-2
# Against the Q4_1 base + adapter (measured: 0.22 nats, 0.048; the F16 base alone moves 0.29, 0.12).
QUANTIZED_LOGPROB, QUANTIZED_P = 0.5, 0.1


@pytest.fixture(scope="module")
def adapter() -> Path:
    folder = trained.folder("three-phase")
    assert folder is not None
    return folder


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fold")


@pytest.fixture(scope="module")
def cache(work):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(work / "cache"))
        yield work / "cache"


@pytest.fixture(scope="module")
def prompts(vocab_chat) -> tuple[list[list[int]], list[list[int]]]:
    calls = [vocab_chat.answer_ids(tool_call_text(HIT)), vocab_chat.answer_ids(tool_call_text(STICK))]
    return [vocab_chat.prompt_ids(opening_messages(Observation(*k))) for k in STATES], calls


def read(prompts, model: Path | None, lora: Path | None = None, which: slice = slice(None)) -> np.ndarray:
    """[state, call, token] logprobs of the two calls, one thread, llama.cpp's batched kernels."""
    from blackjack_rl.policies.embedded import EmbeddedPolicy

    policy = EmbeddedPolicy(model, n_ctx=1024, n_threads=1, lora_path=lora)
    try:
        ids, calls = prompts
        return np.array([policy.score_answers(p, calls, 1.0, same_kernels=False) for p in ids[which]])
    finally:
        policy._worker.shutdown(wait=True)
        policy.llama.close()


def p_hit(reading: np.ndarray) -> np.ndarray:
    return np.array([hit_share(h.sum(), s.sum()) for h, s in reading])


def gaps(reading: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """The largest per-token logprob gap and the largest P(hit | valid) gap."""
    return float(np.abs(reading - reference).max()), float(np.abs(p_hit(reading) - p_hit(reference)).max())


@pytest.fixture(scope="module")
def reencoded(adapter, work) -> Path:
    """The base with the adapted weights re-encoded as F16 and no update: a fold of weight 0."""
    return fold_lora_gguf(adapter, None, work / "reencoded.f16.gguf", weight=0.0)


@pytest.fixture(scope="module")
def reference(prompts, reencoded, adapter) -> np.ndarray:
    """llama.cpp applying the adapter at run time, on the re-encoded base."""
    return read(prompts, reencoded, adapter)


@pytest.fixture(scope="module")
def folded(adapter, cache) -> Path:
    return folded_gguf("three-phase")


@pytest.fixture(scope="module")
def fold_reading(prompts, folded) -> np.ndarray:
    return read(prompts, folded)


def test_the_fold_is_the_adapter_llama_cpp_applies(reference, fold_reading):
    lp, p = gaps(fold_reading, reference)
    assert lp < EXACT_LOGPROB and p < EXACT_P, (lp, p)
    assert (p_hit(fold_reading) > 0.5).tolist() == (p_hit(reference) > 0.5).tolist()
    assert np.ptp(p_hit(reference)) > 0.9  # the states tell the actions apart: some hit, some stick


def test_the_fold_plays_as_the_quantized_model_with_the_adapter(prompts, adapter, fold_reading):
    shipped = read(prompts, None, adapter)  # what `--lora three-phase` runs
    lp, p = gaps(fold_reading, shipped)
    assert lp < QUANTIZED_LOGPROB and p < QUANTIZED_P, (lp, p)
    clear = np.abs(p_hit(shipped) - 0.5) > QUANTIZED_P
    assert clear.sum() >= 15
    assert ((p_hit(fold_reading) > 0.5) == (p_hit(shipped) > 0.5))[clear].all()


@pytest.mark.parametrize("wrong", ["no update", "no rotary order"])
def test_a_wrong_fold_fails_the_comparison(prompts, adapter, reference, reencoded, work, monkeypatch, wrong):
    if wrong == "no update":
        model = reencoded
    else:
        monkeypatch.setattr(gguf_lora, "_rotary_order", lambda rows, heads: rows)
        model = fold_lora_gguf(adapter, None, work / "no-rotary.f16.gguf")
    lp, p = gaps(read(prompts, model, which=FEW), reference[FEW])
    assert lp > 20 * EXACT_LOGPROB and p > 20 * EXACT_P, (lp, p)


def test_the_scale_is_alpha_over_rank_as_llama_cpp_reads_it(prompts, adapter, reference, reencoded, work, cache):
    """The shipped adapter has alpha = rank (scale 1): a copy with half its alpha checks the scale."""
    half = work / "half-alpha"
    shutil.copytree(adapter, half, ignore=shutil.ignore_patterns("adapter.gguf"))
    config = json.loads((half / "adapter_config.json").read_text())
    config["lora_alpha"] = config["r"] / 2
    (half / "adapter_config.json").write_text(json.dumps(config))
    assert fold_cache_path(half) != fold_cache_path(adapter)  # a changed adapter never reuses a fold
    runtime = read(prompts, reencoded, half, FEW)  # llama.cpp converts the copy itself (embedded._gguf_adapter)
    lp, p = gaps(read(prompts, folded_gguf(half), which=FEW), runtime)
    assert lp < EXACT_LOGPROB and p < EXACT_P, (lp, p)
    lp, p = gaps(runtime, reference[FEW])
    assert lp > 20 * EXACT_LOGPROB and p > 20 * EXACT_P, (lp, p)  # and half the update is another model


def test_the_fold_keeps_everything_else_and_is_kept_once(adapter, folded, cache, gguf_path):
    assert folded.parent == cache / "blackjack-rl" / "folded" and folded == fold_cache_path(adapter)
    made = folded.stat().st_mtime_ns
    assert folded_gguf(adapter) == folded and folded.stat().st_mtime_ns == made
    assert not list(folded.parent.glob("*.tmp*"))
    base, out = gguf.GGUFReader(str(gguf_path)), gguf.GGUFReader(str(folded))
    assert set(out.fields) - set(base.fields) == {FIELD}
    for name, field in base.fields.items():
        if not name.startswith("GGUF.") or name == "GGUF.version":
            assert out.fields[name].contents() == field.contents(), name
    adapted = set(gguf_lora.lora_pairs(adapter, base))
    assert len(adapted) == 6 * 7
    for a, b in zip(base.tensors, out.tensors, strict=True):
        assert (a.name, list(a.shape)) == (b.name, list(b.shape))
        if a.name in adapted:
            assert b.tensor_type == gguf.GGMLQuantizationType.F16
        else:
            assert (a.tensor_type, a.data.tobytes()) == (b.tensor_type, b.data.tobytes()), a.name


def test_what_cannot_fold_is_one_clear_error(adapter, work):
    with pytest.raises(ValueError, match="out_type"):
        fold_cache_path(adapter, out_type="q4_0")
    with pytest.raises(FileNotFoundError, match="only those fold"):
        folded_gguf(adapter / "adapter.gguf")
    dora = work / "dora"
    shutil.copytree(adapter, dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="only plain LoRA"):
        fold_lora_gguf(dora, None, work / "never.gguf")
    assert not (work / "never.gguf").exists()


def test_lora_fold_plays_the_cached_fold_and_every_page_names_it(prompts, folded, fold_reading, cache, tmp_path):
    """`--lora three-phase --lora-fold f16` loads the fold `folded_gguf` keeps (the same readings as
    that file loaded directly), records the adapter and the fold, and the report's title says both."""
    from blackjack_rl.config import Settings
    from blackjack_rl.contract.tokens import EMBEDDED_GGUF_NAME
    from blackjack_rl.policies import make_policy
    from blackjack_rl.report.modes import policy_name

    settings = Settings.model_validate({"policy": {"lora": "three-phase", "lora_fold": "f16", "n_threads": 1,
                                                   "n_ctx": 1024}})
    kept = sorted((cache / "blackjack-rl" / "folded").iterdir())
    assert folded in kept
    policy = make_policy(settings).policy
    try:
        ids, calls = prompts
        reading = np.array([policy.score_answers(p, calls, 1.0, same_kernels=False) for p in ids])
        params = policy.generation_params()
    finally:
        policy._worker.shutdown(wait=True)
        policy.llama.close()
    assert np.array_equal(reading, fold_reading)
    assert params["lora"] == "three-phase" and params["lora_fold"] == "f16"
    assert params["model"] == EMBEDDED_GGUF_NAME  # the base it was folded over, not the cache file
    assert policy_name(params) == f"{EMBEDDED_GGUF_NAME} + LoRA three-phase (folded, f16)"
    assert sorted((cache / "blackjack-rl" / "folded").iterdir()) == kept  # the kept fold was used: no second one

    from helpers import run_cli

    for argv, says in ((["--lora-fold", "f16"], "without --lora"),
                       (["--lora", "three-phase", "--lora-fold", "q4_1"], "--lora-fold"),
                       (["--policy", "optimal", "--lora", "three-phase", "--lora-fold", "f16"], "--lora")):
        run = run_cli("evaluate", *argv, "--episodes", "1", "--out", str(tmp_path / "o"), cwd=tmp_path)
        assert run.returncode == 2 and says in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
