"""Settings, one pydantic model per concern.

Precedence, highest first: command-line flags, environment variables
(`BLACKJACK_RL_<SECTION>__<FIELD>`, e.g. `BLACKJACK_RL_POLICY__BASE_URL`), the YAML
file given with `--config`, then the defaults below, which run out of the box on
the embedded model.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict, YamlConfigSettingsSource

if TYPE_CHECKING:  # game.py imports Gymnasium, which the command line's help and `api` do not need
    from blackjack_rl.game.table import Rules

# How `--constrained` asks a chat server for structured output (policies/structured.py builds the requests)
StructuredOutput = Literal["json_schema", "json_object", "structured_outputs", "guided_json", "tool_choice"]

PolicyKind = Literal["embedded", "openai", "optimal", "threshold", "random", "hf"]


def _http_url(text: str) -> str:
    """A server's address is refused here, in one line, rather than by the HTTP client after all
    its retries."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises on a port that is not a number in range
    except ValueError as exc:
        raise ValueError(f"{text!r} is not a URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{text!r} is not an http:// or https:// URL with a host, e.g. http://127.0.0.1:8000")
    return text


HttpUrlText = Annotated[str, AfterValidator(_http_url)]


def _saved_adapter(path: Path) -> Path:
    """A shipped adapter by name (`--base-adapter whole-game`), as `--lora` and `--model-path` take
    one; a path that exists always wins, and any other is left for the trainer to refuse."""
    from blackjack_rl.trained import model_folder

    return Path(model_folder(str(path)))


SavedAdapter = Annotated[Path, AfterValidator(_saved_adapter)]


class _Section(BaseModel):
    # NaN and infinity are never meant: a NaN score or temperature would be written into
    # metrics.json (invalid JSON) or sampled with, instead of being refused here.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class GameConfig(_Section):
    """The table's rules (Gymnasium Blackjack-v1) and how long an episode may run."""

    natural: bool = Field(False, description="a natural pays 1.5 (Blackjack-v1 `natural`)")
    sab: bool = Field(False, description="Sutton & Barto rules (Blackjack-v1 `sab`); overrides natural")
    max_turns: int = Field(10, ge=1, le=64, description="model turns before an unfinished episode is cut")

    @property
    def rules(self) -> Rules:
        from blackjack_rl.game.table import Rules

        return Rules(natural=self.natural, sab=self.sab)


def parse_server(text: str) -> tuple[str, float]:
    """`URL` or `URL,WEIGHT` (the `--server` flag's format); the URL and weight are checked by
    ServerConfig and the pool's ServerSpec."""
    url, sep, weight = text.strip().rpartition(",")
    if not sep:
        return weight, 1.0
    try:
        return url.strip(), float(weight)
    except ValueError:
        raise ValueError(f"--server {text!r}: expected URL or URL,WEIGHT with a positive number") from None


class ServerConfig(_Section):
    """One inference server of a pool; in YAML a mapping, or the string `URL[,WEIGHT]` like --server."""

    url: HttpUrlText
    weight: float = Field(1.0, gt=0, description="share of the load relative to the other servers")
    max_concurrency: int | None = Field(None, ge=1, description="requests in flight at once (default: the pool's)")

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        if isinstance(value, str):
            url, weight = parse_server(value)
            return {"url": url, "weight": weight}
        return value

    @model_validator(mode="after")
    def _http(self) -> "ServerConfig":
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"server URL {self.url!r} must start with http:// or https://")
        return self


class PolicyConfig(_Section):
    """Who plays, and how it is asked: the model or bot, its servers, sampling and decoding."""

    kind: PolicyKind = Field(
        "embedded", description="who plays: embedded (SmolLM2-135M-Instruct in llama.cpp), openai (an "
                                "OpenAI-compatible server), hf (a torch model, e.g. one saved by `train`; needs the "
                                "train extra), or a bot", json_schema_extra={"flag": "--policy"})
    model_path: str | None = Field(
        None, description="a GGUF for the embedded policy, or a GGUF or a model folder saved by `train` for hf "
                          "(default: SmolLM2-135M-Instruct)", json_schema_extra={"metavar": "PATH"})
    base_url: HttpUrlText = Field("http://127.0.0.1:8000/v1", description="the OpenAI-compatible server")
    model: str | None = Field(None, description="model name on the server")
    api_key: str | None = Field(None, description="server API key (or BLACKJACK_RL_POLICY__API_KEY)")
    tokenizer: str | None = Field(
        None, description="Hugging Face tokenizer name or folder (or a .gguf) for the trajectory tokens "
                          "(default: --model for servers, the embedded GGUF for bots)"
    )
    temperature: float = Field(1.0, ge=0.0, le=5.0, description="sampling temperature")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling: sample among the most likely tokens "
                                                          "that together hold this probability (1: off)")
    top_k: int = Field(0, ge=0, description="sample among the K most likely tokens (0: off)")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="drop tokens less likely than this times the most likely "
                                                          "one (0: off)")
    max_tokens: int = Field(64, ge=1, le=8192, description="new tokens per model turn")
    timeout: float = Field(60.0, gt=0, description="seconds per server request")
    retries: int = Field(2, ge=0, le=10, description="retries on timeouts and 5xx")
    native_tools: bool = Field(False, description="send the tool schema as `tools` (server-side tool parser)")
    constrained: bool = Field(
        False, description="constrained decoding, every answer a valid call: a token-level constraint to the two "
                           "valid answers (embedded) or the server's structured output (openai, see "
                           "--structured-output); for play and evaluation")
    structured_output: StructuredOutput = Field(
        "json_schema", description="how --constrained asks a chat server for structured output "
                                   "(json_schema: OpenAI/vLLM/SGLang/llama-server; json_object: llama-cpp-python; "
                                   "structured_outputs, guided_json: vLLM new/old; tool_choice: forced tool call)"
    )
    threshold: int = Field(17, ge=2, le=22, description="the threshold bot hits below this sum")
    n_threads: int | None = Field(None, ge=1, description="llama.cpp threads (default: one per core that other "
                                                          "processes leave free, revisited as the load changes)",
                                  json_schema_extra={"flag": "--threads", "metavar": "N"})
    lora: str | None = Field(None, description="embedded: a LoRA adapter llama.cpp applies to the GGUF: a shipped "
                                              "one by name (three-phase: the trained model), a .gguf adapter, or a "
                                              "folder saved by `train --lora` (converted on load)",
                             json_schema_extra={"metavar": "NAME_OR_PATH"})
    lora_fold: Literal["f16", "q8_0"] | None = Field(
        None, description="embedded, with --lora: fold the adapter into the model's weights once (cached in "
                          "~/.cache/blackjack-rl/folded), stored as TYPE, instead of applying it at every token: "
                          "faster, with probabilities that differ slightly (docs/inference.md)",
        json_schema_extra={"metavar": "TYPE"})
    n_ctx: int | None = Field(None, ge=256, description="llama.cpp context (default: the episode token budget)")
    max_batch: int = Field(64, ge=1, description="hf: answers sampled in one batched forward (the turns of "
                                                 "concurrent episodes and a group's answers batch up to it)")
    servers: list[ServerConfig] = Field(
        default_factory=list, description="an inference server of a pool (repeat for more); each conversation stays "
                                          "on one healthy server, and conversations spread over the servers by "
                                          "weight; replaces --base-url",
        json_schema_extra={"flag": "--server", "metavar": "URL[,WEIGHT]"}
    )
    server_api: Literal["vllm", "sglang", "llamacpp"] = Field(
        "vllm", description="the servers' token-id API: vLLM /v1/completions, SGLang /generate, llama.cpp /completion"
    )
    token_path: Literal["auto", "completions", "chat"] | None = Field(
        None, description="token ids (completions) or chat text; auto asks the servers. Default: auto with servers, "
                          "else the single-server chat client"
    )
    max_concurrency_per_server: int = Field(128, ge=1, description="requests in flight per server",
                                            json_schema_extra={"flag": "--server-concurrency"})
    sticky: bool = Field(True, description="keep every turn of an episode and every answer of a group on one server "
                                           "while it is healthy, so its prefix cache hits (off: send each request to "
                                           "the least-loaded server)")

    @model_validator(mode="after")
    def _server_needs_model(self) -> "PolicyConfig":
        if self.kind == "openai" and not self.model:
            raise ValueError("--policy openai needs --model NAME (the model name the server serves)")
        return self


class EpisodeConfig(_Section):
    """How an episode is played and scored."""

    invalid_score: float = Field(-1.0, description="score of an episode that ends on an invalid answer")
    max_token_length: int = Field(1024, ge=128, description="token budget of a whole episode (prompt + all turns)")
    scoring: Literal["outcome", "expected"] = Field(
        "outcome", description="outcome: the game reward; expected: V*(s0) minus the regret of each decision "
                               "(same mean, far lower variance; both are always recorded)"
    )
    format_bonus: float = Field(0.0, description="added for well-formed answers (share of valid answers)")
    invalid_retries: int = Field(0, ge=0, le=16, description="re-prompt after an invalid answer, with the reason, up "
                                                             "to N times before the episode forfeits (0: at once)")
    thinking: bool = Field(False, description="the model reasons in <think>...</think> before its call; older "
                                              "thoughts are cut to fit")
    think_budget: int = Field(192, ge=0, description="extra new tokens per turn for reasoning in thinking mode")


# How a deal becomes groups and what each sequence is credited with (docs/training/README.md):
# - episode: whole episodes on one deal, one score per sequence (GRPO's group baseline);
# - episode-tokens: the same episodes, each answer's format tokens credited with its validity
#   and its action word with the decision's Q* (per-token `advantages`);
# - step: one group per decision, each answer scored by Q*(s, a), each sequence the shared
#   prompt plus one answer;
# - step-tokens: step groups with per-token advantages;
# - step-counterfactual: step groups that also hold both valid calls, forced and carrying the
#   policy's own logprobs: the exact all-action gradient (embedded and hf policies);
# - step-rollouts: the same groups, each action's value estimated from the table's rewards alone
#   (K rollouts per action with common random numbers, the policy continuing): no solver output
#   enters the credit, the states trained or their weights.
CreditMode = Literal["episode", "episode-tokens", "step", "step-tokens", "step-counterfactual", "step-rollouts"]
STEP_MODES = ("step", "step-tokens", "step-counterfactual", "step-rollouts")
TOKEN_MODES = ("episode-tokens", "step-tokens", "step-counterfactual", "step-rollouts")
# What a reward-only mode refuses: each chooses or weighs states by the solver's optimal action.
SOLVER_CHOICES = {"starts": "chart", "continue_with": "best"}


class GroupConfig(_Section):
    """How episodes become GRPO groups and what each sequence is credited with: one credit mode
    and the few parameters that vary within it, checked together here."""

    credit: CreditMode = Field(
        "episode", description="episode | episode-tokens (per-token format and Q* decision credit) | step (a group "
                               "per decision, answers scored by Q*) | step-tokens | step-counterfactual (also both "
                               "calls, forced, with the policy's logprobs: the exact all-action gradient) | "
                               "step-rollouts (the same groups, credited from the table's rewards alone)")
    group_size: int = Field(16, ge=0, le=1024, description="episodes per group, all on one deal (step groups: answers "
                                                           "per decision; step-counterfactual: answers sampled besides "
                                                           "the two calls, 0 allowed)")
    drop_equal_scores: bool = Field(False, description="drop groups whose scores are all equal (no GRPO signal)")
    concurrency: int = Field(64, ge=1, description="episodes played at once")
    continue_with: Literal["sampled", "best"] = Field(
        "sampled", description="step modes: the answer the canonical episode continues with"
    )
    starts: Literal["deal", "chart", "uniform"] = Field(
        "deal", description="step modes: deal: each deal starts where the cards put it; chart: in a strategy-chart "
                            "state, hit-optimal or stick-optimal with equal chance (exploring starts, for training); "
                            "uniform: in a chart state drawn uniformly, whatever its optimal action")
    rollouts: int = Field(16, ge=1, le=1024, description="step-rollouts: rollouts per action at each decision (K)")
    rollout_continuation: Literal["history", "chart"] = Field(
        "history", description="step-rollouts: how the policy plays on after a hit: history: asked at the prompt "
                               "the game would show (its own Q^pi); chart: asked at the new hand's opening prompt, "
                               "as if it were a first decision (a Markov projection of the policy, whose prompts "
                               "repeat across steps, so the trainer's frozen trunk caches them)")
    rollout_refresh: int = Field(
        1, ge=1, le=100_000, description="train, step-rollouts with --rollout-continuation chart: training steps "
                                         "a snapshot of the continuation serves: 1: the policy of the step itself; "
                                         "N: its chart scored once and held for N steps, so the credit's target "
                                         "stands still while the decisions move toward it (policy iteration)")
    forced_weight: Literal["policy", "none", "greedy"] = Field(
        "policy", description="step-counterfactual, step-rollouts: the forced calls' credit: policy: p(a) (Q(a) - V), "
                              "the exact all-action gradient, which vanishes where the policy is sure of one call; "
                              "none: Q(a) - V, so a policy sure of the wrong call still learns the other; greedy: "
                              "the better call gets the gap and the other nothing, the cross-entropy toward the "
                              "better call, which fades only where the policy is right")
    decisions: Literal["all", "first"] = Field(
        "all", description="step modes: all: a group at every decision of a deal; first: at its first decision only "
                           "(later prompts carry the game's history)")
    scale_decisions: bool = Field(
        False, description="token modes: divide each decision's credit by |Q*(hit) - Q*(stick)| (floored at "
                           "0.05), as GRPO divides a group by its spread, so every state weighs the same")
    format_weight: float = Field(
        1.0, ge=0.0, le=100.0, description="token modes: weight of the validity credit on an answer's format "
                                           "tokens (0: train the decision only)")
    format_credit: Literal["gap", "likelihood"] = Field(
        "gap", description="counterfactual modes: the forced calls' format credit: gap: the validity score less "
                           "the policy's expected one, the gradient of P(valid), which fades as (1 - P(valid))^2 "
                           "near a learned format; likelihood: --format-weight times each call's share of the "
                           "two, the gradient of log P(one of the two calls), which fades only as 1 - P(valid)")
    balance_actions: bool = Field(False, description="train, step modes: weigh each batch's decisions so that "
                                                     "hit-optimal and stick-optimal states count equally "
                                                     "(step-rollouts: by the action its estimate values higher)")
    balance_by: Literal["count", "credit"] = Field(
        "count", description="train, with --balance-actions: what the two classes weigh equally: their number of "
                             "decisions, or (counterfactual modes) their credit's summed pull on the hit/stick "
                             "logit difference, so that the batch's net pull on one shared preference is zero")
    balance_later: bool = Field(False, description="train, with --balance-actions: balance first decisions and "
                                                   "decisions after a hit apart, so that a history (\"I hit "
                                                   "before\") earns nothing as a reason for one action")

    @model_validator(mode="after")
    def _parameters_of_the_mode(self) -> "GroupConfig":
        """The one place that says which parameters act in which credit mode."""
        mode, defaults = self.credit, GroupConfig.model_fields
        if self.group_size == 0 and mode not in ("step-counterfactual", "step-rollouts"):
            raise ValueError("--group-size 0 makes groups of the two forced calls only: it needs "
                             "--credit step-counterfactual or step-rollouts")
        if mode not in STEP_MODES:
            for name in ("continue_with", "starts", "decisions", "balance_actions", "balance_later"):
                if getattr(self, name) != defaults[name].default:
                    raise ValueError(f"--{name.replace('_', '-')} is for step groups: use --credit step, step-tokens "
                                     f"or step-counterfactual (not {mode})")
        if mode not in TOKEN_MODES:
            for name in ("scale_decisions", "format_weight"):
                if getattr(self, name) != defaults[name].default:
                    raise ValueError(f"--{name.replace('_', '-')} weighs per-token advantages: use --credit "
                                     f"episode-tokens, step-tokens or step-counterfactual (not {mode})")
        if self.format_credit != "gap" and not self.counterfactual:
            raise ValueError("--format-credit likelihood credits the forced calls of --credit step-counterfactual or "
                             f"step-rollouts (not {mode})")
        if self.forced_weight != "policy" and not self.counterfactual:
            raise ValueError("--forced-weight weighs the forced calls of --credit step-counterfactual or "
                             f"step-rollouts (not {mode})")
        if self.rollout_refresh != 1 and self.rollout_continuation != "chart":
            raise ValueError("--rollout-refresh holds a snapshot of the chart continuation: it needs "
                             "--credit step-rollouts --rollout-continuation chart (a history continuation's "
                             "prompts cannot all be scored ahead)")
        for name in ("rollouts", "rollout_continuation"):
            if mode != "step-rollouts" and getattr(self, name) != defaults[name].default:
                raise ValueError(f"--{name.replace('_', '-')} sets the rollouts of --credit step-rollouts (not {mode})")
        if mode == "step-rollouts":
            for name, value in SOLVER_CHOICES.items():
                if getattr(self, name) == value:
                    flag = f"--{name.replace('_', '-')}" + ("" if value is True else f" {value}")
                    raise ValueError(f"{flag} chooses or weighs states by the solver's optimal action, which "
                                     "--credit step-rollouts never reads (reward only)")
        if self.balance_by != "count":
            if not self.balance_actions:
                raise ValueError("--balance-by says how --balance-actions weighs the classes: add --balance-actions")
            if not self.counterfactual:
                raise ValueError("--balance-by credit weighs each decision by its credit's pull on the two calls, "
                                 "which only counterfactual groups hold: use --credit step-counterfactual or "
                                 f"step-rollouts (not {mode})")
        if self.balance_later and not self.balance_actions:
            raise ValueError("--balance-later balances hit and stick among later decisions: it needs "
                             "--balance-actions")
        if self.balance_later and self.decisions == "first":
            raise ValueError("--balance-later weighs decisions after a hit, which --decisions first never makes")
        return self

    @property
    def group_by(self) -> Literal["episode", "step"]:
        return "step" if self.credit in STEP_MODES else "episode"

    @property
    def counterfactual(self) -> bool:
        """Groups that hold both valid calls, forced (credited by Q* or by rollouts)."""
        return self.credit in ("step-counterfactual", "step-rollouts")

    @property
    def token_advantages(self) -> bool:
        return self.credit in TOKEN_MODES

    @property
    def sequences(self) -> int:
        """Sequences in each group: the sampled answers, plus the two forced calls of a
        counterfactual step group."""
        return self.group_size + (2 if self.counterfactual else 0)


class EvalConfig(_Section):
    """`evaluate`: the fixed evaluation deals and what is written about them."""

    episodes: int = Field(1000, ge=1, description="evaluation deals")
    concurrency: int = Field(64, ge=1, description="episodes played at once")
    samples: bool = Field(True, description="write every episode to samples.jsonl")
    versus_base: bool = Field(False, description="with --lora: also play the same deals with the base model alone, "
                                                 "and print both side by side with their paired differences "
                                                 "(OUT/base/, OUT/adapter/, OUT/compare.html)")
    grid: bool = Field(False, description="also the exact strategy chart: P(hit) in all 280 states from the policy's "
                                          "probabilities, its exact expected return, accuracy and regret (embedded, hf "
                                          "and bots; in metrics.json and report.html)")
    game_budget: int | None = Field(None, ge=0, le=1_000_000, description="with --grid, and for `grid`: histories of "
                                                                        "the whole game read after the chart (default "
                                                                        "1000 for a model, every one for a bot; 0: "
                                                                        "the chart alone, without the whole game)")


class ProcessConfig(_Section):
    """`process`: how much data to write."""

    groups: int = Field(8, ge=1, description="number of groups")


class ServeConfig(_Section):
    """`serve`: the environment worker that feeds the trajectory API."""

    api_url: HttpUrlText = Field("http://127.0.0.1:8000", description="the trajectory API")
    api_token: str | None = Field(None, description="bearer token of the API (or BLACKJACK_RL_SERVE__API_TOKEN)")
    env_name: str = Field("blackjack", description="name to register under")
    worker_id: str | None = Field(None, description="names this worker: mixed into the deal seeds so workers play "
                                                     "different deals; a restart with the same id continues its deals "
                                                     "and takes over its API registration (default: host and process id)")
    weight: float = Field(1.0, description="this environment's share of each batch (Atropos env weight)")
    min_batch_allocation: float | None = Field(None, ge=0.0, le=1.0, description="minimum share of each batch (0-1)")
    max_batches_offpolicy: int = Field(3, ge=1, description="batches of groups kept queued or in flight ahead of the trainer")
    steps_per_eval: int = Field(100, ge=0, description="evaluate every N trainer steps (0: never)")
    fidelity_every: int = Field(0, ge=0, le=10_000, description="score the credit of each N groups sent against the "
                                                              "exact A^pi of this worker's policy, which played them "
                                                              "(0: never); the trainer's policy is another: `train "
                                                              "--source api --fidelity-every` scores against it")
    eval_episodes: int = Field(200, ge=1, description="episodes per evaluation")
    max_groups: int | None = Field(None, ge=1, description="stop after sending this many groups (default: run until "
                                                           "SIGTERM)")
    register_timeout: float | None = Field(None, gt=0, description="give up waiting for the trainer after N s "
                                                                  "(default: wait forever)")
    drain_timeout: float = Field(60.0, ge=0, description="on SIGTERM, seconds to finish groups in flight")
    poll_interval: float = Field(1.0, gt=0, description="seconds between status checks of the API")


class RayConfig(_Section):
    """`--ray`: evaluate / process in shards on a Ray cluster, serve workers as Ray actors (the `ray` extra)."""

    address: str | None = Field(
        None, description="run on a Ray cluster: auto joins the one `ray start` runs on this node, HOST:PORT another; "
                          "no address (local) starts one for this command; evaluate and process split the deals into "
                          "shards, merged in seed order", json_schema_extra={"flag": "--ray", "metavar": "ADDRESS",
                                                                              "const": "local"})
    actors: int | None = Field(None, ge=1, description="evaluate/process: shard actors (default: cluster CPUs / "
                                                      "--ray-cpus)", json_schema_extra={"flag": "--ray-actors",
                                                                                       "metavar": "N"})
    cpus: float = Field(1.0, gt=0, description="CPUs reserved per actor (also its llama.cpp/torch threads)",
                        json_schema_extra={"flag": "--ray-cpus", "metavar": "N"})
    workers: int = Field(1, ge=1, le=1024, description="serve: worker actors, worker ids ID-0..ID-(N-1), each with "
                                                       "its own deals; a dead one is restarted with its id")
    max_restarts: int = Field(100, ge=0, description="serve: restarts of one worker before the command gives up")


class TrainConfig(_Section):
    """`blackjack-rl train`: GRPO on the torch policy (needs the `train` extra)."""

    source: Literal["local", "api"] = Field(
        "local", description="local: play groups with the model being trained; api: pull batches from the trajectory API "
                             "(the answers are then sampled by whatever model `serve` runs)")
    steps: int = Field(50, ge=1, description="optimizer steps")
    deals_per_step: int = Field(4, ge=1, description="local: deals played per step (one group each, or one per decision)")
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate")
    warmup_steps: int = Field(0, ge=0, le=100_000, description="raise the learning rate linearly over the first N steps "
                                                            "(a fresh Adam's first steps are full-size in every "
                                                            "parameter; warm-up keeps them small while it learns "
                                                            "the gradients' sizes)")
    decay_steps: int = Field(0, ge=0, le=100_000, description="lower the learning rate linearly over the last N of "
                                                           "--steps, to 1/(N+1) of it at the last (warm-up, "
                                                           "stable, decay: the last steps settle where a constant "
                                                           "rate keeps the policy swinging)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    adam_beta2: float = Field(0.999, gt=0, lt=1, description="AdamW beta2: how long it remembers gradient sizes "
                                                             "(0.9: ~10 steps; lower it when one credit fades and "
                                                             "a smaller one must take over)")
    adam_eps: float = Field(1e-8, gt=0, le=1.0, description="AdamW epsilon: near a coordinate's typical gradient "
                                                           "size, steps on smaller gradients shrink with them "
                                                           "instead of being scaled up to the learning rate")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping: largest gradient norm")
    clip_eps: float = Field(0.2, gt=0, description="PPO clip of the importance ratio")
    kl_coef: float = Field(0.0, ge=0, description="weight of the KL to the initial model (0: no reference model)")
    skip_certain: float = Field(0.0, ge=0.0, le=0.01, description="leave untrained the tokens the policy wrote with "
                                                                 "probability at least 1 - this (by their sampling "
                                                                 "logprobs): each one's gradient at the logits is at "
                                                                 "most sqrt(2) x this x its advantage, and a learned "
                                                                 "call's ~20 tokens then cost the LM head nothing "
                                                                 "(0: train every token; needs --kl-coef 0)")
    scale_advantages: bool = Field(True, description="divide advantages by the group's score std (GRPO; off: Dr. GRPO)")
    updates_per_batch: int = Field(1, ge=1, description="optimizer steps on each batch (>1 makes later ones off-policy)")
    lora: bool = Field(False, description="train LoRA adapters (peft) instead of every weight")
    lora_rank: int = Field(16, ge=1, description="LoRA rank")
    lora_alpha: float = Field(32.0, gt=0, description="LoRA alpha")
    train_layers: int | None = Field(None, ge=1, description="train only the top N decoder layers (cheaper backward)")
    max_train_rows: int = Field(32, ge=1, le=1024, description="sequences in one training forward (memory grows with it)")
    eval_every: int = Field(10, ge=0, description="evaluate every N steps (0: only before and after)")
    eval_episodes: int = Field(200, ge=0, description="fixed evaluation deals per evaluation (0: no evaluation)")
    save_every: int = Field(0, ge=0, description="checkpoint every N steps (0: only the final model)")
    grid_every: int = Field(1, ge=0, description="exact strategy-chart evaluation every N steps (0: only with "
                                                 "the sampled evaluations)")
    fidelity_every: int = Field(0, ge=0, description="score the step's credit against the exact advantage A^pi of the "
                                                     "policy that played it, every N steps (0: never; not counted as "
                                                     "training time): local, on fixed probe deals; api, on the "
                                                     "pulled batch, against the trainer's policy")
    fidelity_probes: int = Field(8, ge=1, le=1_000, description="local: pairs of fixed probe deals for "
                                                                 "--fidelity-every, each pair opening on one state "
                                                                 "(two independent draws of its credit)")
    game_budget: int = Field(400, ge=0, le=100_000, description="histories of the whole game each chart reads, its "
                                                                 "~270 first decisions included (0: the chart alone; "
                                                                 "a history after a hit costs about a chart cell)")
    resume: Path | None = Field(None, description="continue from a checkpoint folder written by --save-every "
                                                  "(weights, optimizer state, step, deal stream)",
                                json_schema_extra={"metavar": "CHECKPOINT"})
    init_adapter: SavedAdapter | None = Field(None, description="LoRA: start the adapters from this saved adapter (OUT/adapter, "
                                                               "a checkpoint of an earlier run, or a shipped one by "
                                                               "name), with a fresh optimizer",
                                      json_schema_extra={"metavar": "DIR"})
    base_adapter: SavedAdapter | None = Field(None, description="LoRA: fold this saved adapter (a folder, or a shipped "
                                                               "one by name: whole-game) into the weights and train a "
                                                               "fresh one over it; checkpoints and the final adapter "
                                                               "hold both, as one adapter of the summed rank over the "
                                                               "base model",
                                      json_schema_extra={"metavar": "DIR"})
    max_minutes: float | None = Field(None, gt=0, description="stop after this many minutes of training (charts and "
                                                              "evaluations not counted), then evaluate and save")
    api_url: HttpUrlText = Field("http://127.0.0.1:8000", description="api: the trajectory API")
    api_token: str | None = Field(None, description="api: bearer token (or BLACKJACK_RL_TRAIN__API_TOKEN)")
    batch_size: int | None = Field(None, ge=1, description="api: sequences per batch (default deals_per_step x group_size)")
    batch_timeout: float = Field(600.0, gt=0, description="api: seconds to wait for a batch")

    @model_validator(mode="after")
    def _skip_needs_no_reference(self) -> "TrainConfig":
        if self.skip_certain and self.kl_coef:
            raise ValueError("--skip-certain drops tokens from the policy-gradient loss, but the KL term of "
                             "--kl-coef needs every token: use one or the other")
        return self

    @model_validator(mode="after")
    def _saved_adapters_need_lora(self) -> "TrainConfig":
        """Refused here, before a model is loaded, rather than after it (seconds to minutes)."""
        if self.base_adapter is not None and not self.lora:
            raise ValueError("--base-adapter trains a fresh LoRA adapter over a saved one: it needs --lora")
        if self.init_adapter is not None and not self.lora:
            raise ValueError("--init-adapter starts LoRA adapters from a saved one: it needs --lora")
        if self.base_adapter is not None and self.init_adapter is not None:
            raise ValueError("use one of --base-adapter (a fresh adapter over a saved one) and --init-adapter "
                             "(continue a saved adapter)")
        return self


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="BLACKJACK_RL_", env_nested_delimiter="__", extra="forbid", nested_model_default_partial_update=True,
        allow_inf_nan=False,
    )

    seed: int = Field(0, description="base seed: fixes the deals (process) and sampling seeds")
    out: Path = Field(Path("runs/latest"), description="output folder", json_schema_extra={"metavar": "DIR"})
    game: GameConfig = GameConfig()
    policy: PolicyConfig = PolicyConfig()
    episode: EpisodeConfig = EpisodeConfig()
    groups: GroupConfig = GroupConfig()
    evaluate: EvalConfig = EvalConfig()
    process: ProcessConfig = ProcessConfig()
    serve: ServeConfig = ServeConfig()
    ray: RayConfig = RayConfig()
    train: TrainConfig = TrainConfig()


def load_settings(config_file: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Settings:
    """Merge defaults < YAML file < environment < `overrides` (the command line)."""
    if config_file is not None and not Path(config_file).is_file():
        why = "is a folder: pass a YAML file" if Path(config_file).is_dir() else "does not exist"
        raise FileNotFoundError(f"config file {config_file} {why}")

    class _Loaded(Settings):
        @classmethod
        def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):
            sources = [init_settings, env_settings]
            if config_file is not None:
                sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=config_file))
            return tuple(sources)

    if config_file is not None:
        _check_yaml(Path(config_file))
    return _Loaded(**(overrides or {}))


def _check_yaml(path: Path) -> None:
    """A settings file must be YAML text holding a mapping; say where it is not, in one line
    (the YAML source would raise a multi-line parser error or a puzzling TypeError)."""
    import yaml  # only commands given --config pay for it

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"config file {path} is not UTF-8 text") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"config file {path} is not valid YAML{where}: {getattr(exc, 'problem', None) or exc}") from None
    except OSError as exc:
        raise ValueError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    if data is not None and not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of sections (policy:, episode:, ...), "
                         f"not a {type(data).__name__}")
