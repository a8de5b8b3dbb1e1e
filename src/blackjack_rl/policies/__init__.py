"""Who decides: the policies, and `make_policy`, the one place that turns settings into one.

    base.py                the Policy interface (a turn in, a reply out) and InferenceError
    sampling.py            the sampling settings every model policy takes
    embedded.py            the default: a GGUF run in-process by llama.cpp
    torch/                 a torch model (`--policy hf`, the `train` extra): the weights being trained
    openai_chat.py         one OpenAI-compatible chat server
    openai_completions.py  a pool of servers, token ids in and out where they can (pool.py routes)
    bots.py                scripted players: optimal, threshold, random
    gguf_lora.py           a peft LoRA adapter as a llama.cpp GGUF adapter
    gguf_fold.py           a peft LoRA adapter folded into the GGUF's weights (no run-time cost)

Every setting reaches every policy that can honour it; a setting a policy cannot honour is
refused here, in one line that says what to do, instead of being dropped silently (a run
that says `--top-p 0.9` and samples at 1.0 is a wrong result, not a default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from blackjack_rl.policies.base import Policy
from blackjack_rl.policies.sampling import Sampling

if TYPE_CHECKING:
    from blackjack_rl.config import PolicyConfig, Settings
    from blackjack_rl.contract.tokens import ChatFormat

BOTS = ("optimal", "threshold", "random")
# The policies that read each setting, by its flag: one changed from its default for any other
# policy would be ignored, so it is refused (check_supported). The sampling settings, --lora, --max-batch
# and the servers' options have rules of their own there. --api-key is left out: a key kept in the
# environment (BLACKJACK_RL_POLICY__API_KEY) is no choice made for the run at hand.
_READ_BY: dict[str, tuple[str, tuple[str, ...]]] = {
    "base_url": ("--base-url", ("openai",)),
    "model": ("--model", ("openai",)),
    "timeout": ("--timeout", ("openai",)),
    "retries": ("--retries", ("openai",)),
    "tokenizer": ("--tokenizer", ("openai", *BOTS)),  # bots: the ids their text is written with
    "model_path": ("--model-path", ("embedded", "hf", *BOTS)),  # bots: a GGUF to tokenize with
    "n_threads": ("--threads", ("embedded", "hf")),
    "n_ctx": ("--n-ctx", ("embedded",)),
    "threshold": ("--threshold", ("threshold",)),
}


@dataclass(frozen=True)
class BuiltPolicy:
    """A policy and the chat format its trajectories are tokenized with."""

    policy: Policy
    chat: ChatFormat


def sampling_of(settings: Settings) -> Sampling:
    """The settings' sampling; a thinking turn gets the reasoning budget on top of the answer's."""
    p, e = settings.policy, settings.episode
    max_new = p.max_tokens + (e.think_budget if e.thinking else 0)
    return Sampling(p.temperature, p.top_p, p.top_k, p.min_p, max_new)


def make_policy(settings: Settings) -> BuiltPolicy:
    """The policy `settings.policy` describes. Raises ValueError, in one line, for a setting
    the chosen policy cannot honour."""
    p = settings.policy
    check_supported(p)
    _check_threads(p)
    sampling = sampling_of(settings)
    if p.kind == "hf":
        from blackjack_rl.policies.torch.policy import TorchPolicy  # needs the `train` extra (torch)
        from blackjack_rl.trained import model_folder

        policy: Any = TorchPolicy.load(model_folder(p.model_path), sampling=sampling, threads=p.n_threads, max_batch=p.max_batch)
        return BuiltPolicy(policy, policy.chat)
    if p.kind == "embedded":
        from blackjack_rl.policies.embedded import EmbeddedPolicy
        from blackjack_rl.trained import lora_file

        policy = EmbeddedPolicy(
            p.model_path,
            sampling=sampling,
            n_ctx=p.n_ctx or settings.episode.max_token_length,
            n_threads=p.n_threads,
            lora_path=lora_file(p.lora) if p.lora else None,  # with lora_fold, the policy folds it instead
            lora_name=p.lora,
            lora_fold=p.lora_fold,
            constrained=p.constrained,
        )
        return BuiltPolicy(policy, policy.chat)
    from blackjack_rl.contract.tokens import ChatFormat

    chat = ChatFormat.learn(_tokenizer_for(p))
    structured = p.structured_output if p.constrained else None
    if p.kind == "openai" and (p.servers or p.token_path is not None):
        from blackjack_rl.policies.openai_completions import OpenAICompletionsPolicy
        from blackjack_rl.policies.pool import ServerPool, ServerSpec

        specs = [ServerSpec(s.url, s.weight, s.max_concurrency) for s in p.servers] or [ServerSpec(p.base_url)]
        pool = ServerPool(specs, api_key=p.api_key, timeout=p.timeout, retries=p.retries,
                          max_concurrency=p.max_concurrency_per_server, sticky=p.sticky)
        return BuiltPolicy(OpenAICompletionsPolicy(
            pool, p.model or "", chat, api=p.server_api, token_path=p.token_path or "auto", sampling=sampling,
            native_tools=p.native_tools, structured_output=structured,
        ), chat)
    if p.kind == "openai":
        from blackjack_rl.policies.openai_chat import OpenAIChatPolicy

        return BuiltPolicy(OpenAIChatPolicy(
            p.base_url, p.model or "", api_key=p.api_key, sampling=sampling, timeout=p.timeout, retries=p.retries,
            native_tools=p.native_tools, structured_output=structured,
        ), chat)
    from blackjack_rl.game.solver import solve
    from blackjack_rl.policies.bots import OptimalBot, RandomBot, ThresholdBot

    bots = {"optimal": lambda: OptimalBot(solve(settings.game.rules)),
            "threshold": lambda: ThresholdBot(p.threshold), "random": RandomBot}
    return BuiltPolicy(bots[p.kind](), chat)


def _check_threads(p: PolicyConfig) -> None:
    """More threads than this process's cores is refused where the model loads (a Ray actor checks
    its own node): llama.cpp's and torch's threads wait for each other by spinning, so the excess
    slows every token."""
    from blackjack_rl.threads import usable_cpus

    cpus = usable_cpus()
    if p.n_threads is not None and p.n_threads > cpus:
        raise ValueError(f"--threads {p.n_threads}: this process may use {cpus} cores, and threads beyond them "
                         f"spin while they wait: use --threads {cpus} or fewer, or leave it out (one per free core)")


def reads(kind: str, setting: str) -> bool:
    """Whether `--policy kind` reads the policy setting (a PolicyConfig field), by the table above:
    what fills in a default for a policy (a Ray actor's threads) asks this first."""
    readers = _READ_BY.get(setting)
    return readers is None or kind in readers[1]


def check_supported(p: PolicyConfig) -> None:
    """Refuse, in one line naming the policy and the fix, a setting it would otherwise ignore."""
    kind = p.kind
    defaults = type(p).model_fields
    changed = {name for name in ("temperature", "top_p", "top_k", "min_p")
               if getattr(p, name) != defaults[name].default}
    pool_only = [flag for flag, on in (("--server-concurrency", p.max_concurrency_per_server
                                        != defaults["max_concurrency_per_server"].default),
                                       ("--server-api", p.server_api != defaults["server_api"].default),
                                       ("--no-sticky", not p.sticky)) if on]
    if kind != "openai":
        server_only = [flag for flag, on in (("--server", bool(p.servers)), ("--token-path", p.token_path is not None),
                                             ("--native-tools", p.native_tools)) if on] + pool_only
        if server_only:
            raise ValueError(f"{server_only[0]} applies to inference servers, not to --policy {kind}: "
                             "drop it or use --policy openai")
    elif pool_only and not p.servers and p.token_path is None:
        raise ValueError(f"{pool_only[0]} applies to a server pool (--server URL, or --token-path); the chat client "
                         "of --base-url would ignore it: drop it, or name the server with --server")
    if kind == "openai" and p.constrained and p.structured_output == "tool_choice" and p.server_api == "vllm" \
            and (p.servers or p.token_path is not None) and p.token_path != "chat":
        raise ValueError("--structured-output tool_choice forces a chat tool call, which the token-id path (vLLM "
                         "/v1/completions) cannot: use --structured-output json_schema, or --token-path chat")
    for name, (flag, readers) in _READ_BY.items():
        if kind not in readers and getattr(p, name) != defaults[name].default:
            raise ValueError(f"{flag} is read by --policy {', '.join(readers)} only; --policy {kind} would ignore "
                             "it: drop it")
    if p.structured_output != defaults["structured_output"].default and not (kind == "openai" and p.constrained):
        raise ValueError("--structured-output says how --constrained asks an openai server for structured output; " + (
            "without --constrained nothing reads it: drop it or add --constrained" if kind == "openai"
            else f"with --policy {kind} nothing reads it: drop it"))
    if kind != "hf" and p.max_batch != defaults["max_batch"].default:
        raise ValueError(f"--max-batch is how many answers the torch policy samples in one forward; --policy {kind} "
                         "does not batch that way: drop it, or use --policy hf")
    if p.lora_fold and not p.lora:
        raise ValueError("--lora-fold folds the --lora adapter into the model's weights; without --lora it has "
                         "nothing to fold: add --lora NAME_OR_PATH or drop it")
    if p.lora and kind != "embedded":
        raise ValueError("--lora applies an adapter to the embedded llama.cpp model; for --policy hf pass the "
                         "adapter folder as --model-path")
    if kind in BOTS:
        if changed or p.constrained:
            flag = "--constrained" if p.constrained else "--" + sorted(changed)[0].replace("_", "-")
            raise ValueError(f"--policy {kind} is a scripted bot that samples nothing, so {flag} would be ignored: "
                             "drop it, or play a model (--policy embedded, hf or openai)")
    elif kind == "hf" and p.constrained:
        raise ValueError("--policy hf samples freely and cannot constrain its answers: drop --constrained, or use "
                         "--policy embedded --model-path with a GGUF of the model")
    elif kind == "embedded" and p.constrained and changed & {"top_p", "top_k", "min_p"}:
        flag = "--" + sorted(changed & {"top_p", "top_k", "min_p"})[0].replace("_", "-")
        raise ValueError(f"--constrained with the embedded model samples among the valid calls only, so {flag} "
                         "would be ignored: drop one of them")


def _tokenizer_for(p: PolicyConfig):
    """Bots are tokenized like the embedded model unless told otherwise; servers by their own tokenizer."""
    from blackjack_rl.contract.tokens import HFTokenizer, LlamaCppTokenizer, embedded_model_path

    name = p.tokenizer or (p.model if p.kind == "openai" else None)
    if name is None:
        return LlamaCppTokenizer.from_gguf(p.model_path or embedded_model_path())
    if name.endswith(".gguf"):
        return LlamaCppTokenizer.from_gguf(name)
    return HFTokenizer(name)
