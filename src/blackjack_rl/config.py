"""Settings, one pydantic model per concern.

Precedence, highest first: command-line flags, environment variables
(`BLACKJACK_RL_<SECTION>__<FIELD>`, e.g. `BLACKJACK_RL_POLICY__BASE_URL`), the YAML
file given with `--config`, then the defaults below, which run out of the box on
the embedded model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict, YamlConfigSettingsSource

from .game import Rules
from .policies.structured import StructuredOutput

PolicyKind = Literal["embedded", "openai", "optimal", "threshold", "random", "hf"]


class _Section(BaseModel):
    # NaN and infinity are never meant: a NaN score or temperature would be written into
    # metrics.json (invalid JSON) or sampled with, instead of being refused here.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class GameConfig(_Section):
    natural: bool = Field(False, description="a natural pays 1.5 (Blackjack-v1 `natural`)")
    sab: bool = Field(False, description="Sutton & Barto rules (Blackjack-v1 `sab`); overrides natural")
    max_turns: int = Field(10, ge=1, le=64, description="model turns before an unfinished episode is cut")

    @property
    def rules(self) -> Rules:
        return Rules(natural=self.natural, sab=self.sab)


class ServerConfig(_Section):
    """One inference server of a pool; in YAML a mapping, or the string `URL[,WEIGHT]` like --server."""

    url: str
    weight: float = Field(1.0, gt=0, description="share of the load relative to the other servers")
    max_concurrency: int | None = Field(None, ge=1, description="requests in flight at once (default: the pool's)")

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        if isinstance(value, str):
            from .policies.pool import ServerSpec

            spec = ServerSpec.parse(value)
            return {"url": spec.url, "weight": spec.weight}
        return value


class PolicyConfig(_Section):
    kind: PolicyKind = "embedded"
    model_path: str | None = Field(
        None, description="a GGUF for the embedded policy, or a GGUF or saved model folder for hf "
                          "(default: SmolLM2-135M-Instruct)")
    base_url: str = "http://127.0.0.1:8000/v1"
    model: str | None = Field(None, description="model name on the server")
    api_key: str | None = None
    tokenizer: str | None = Field(
        None, description="Hugging Face tokenizer name or folder (default: --model for servers, the embedded GGUF for bots)"
    )
    temperature: float = Field(1.0, ge=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k (embedded only)")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    max_tokens: int = Field(64, ge=1, le=8192, description="new tokens per model turn")
    timeout: float = Field(60.0, gt=0)
    retries: int = Field(2, ge=0, le=10)
    native_tools: bool = Field(False, description="send the tool schema as `tools` (server-side tool parser)")
    constrained: bool = Field(False, description="constrained decoding: always a valid call (play/eval only)")
    structured_output: StructuredOutput = Field(
        "json_schema", description="how --constrained asks a chat server for structured output "
                                   "(json_schema: OpenAI/vLLM/SGLang/llama-server; json_object: llama-cpp-python; "
                                   "structured_outputs, guided_json: vLLM new/old; tool_choice: forced tool call)"
    )
    threshold: int = Field(17, ge=2, le=22, description="the threshold bot hits below this sum")
    n_threads: int | None = Field(None, ge=1)
    lora: str | None = Field(None, description="embedded: a LoRA adapter llama.cpp applies to the GGUF (a .gguf "
                                              "adapter, or a folder saved by `train --lora`, converted on load)")
    n_ctx: int | None = Field(None, ge=256, description="llama.cpp context (default: the episode token budget)")
    servers: list[ServerConfig] = Field(
        default_factory=list, description="a pool of servers (--server URL[,WEIGHT], repeatable); replaces base_url"
    )
    server_api: Literal["vllm", "sglang", "llamacpp"] = Field(
        "vllm", description="the servers' token-id API: vLLM /v1/completions, SGLang /generate, llama.cpp /completion"
    )
    token_path: Literal["auto", "completions", "chat"] | None = Field(
        None, description="token ids (completions) or chat text; auto asks the servers. Default: auto with servers, "
                          "else the single-server chat client"
    )
    max_concurrency_per_server: int = Field(128, ge=1, description="requests in flight per server")
    sticky: bool = Field(True, description="send every turn of an episode and every answer of a group to one server "
                                           "while it is healthy (its prefix cache hits); False: least-loaded only")

    @model_validator(mode="after")
    def _server_needs_model(self) -> "PolicyConfig":
        if self.kind == "openai" and not self.model:
            raise ValueError("--policy openai needs --model NAME (the model name the server serves)")
        return self


class EpisodeConfig(_Section):
    invalid_score: float = Field(-1.0, description="score of an episode that ends on an invalid answer")
    max_token_length: int = Field(1024, ge=128, description="token budget of a whole episode (prompt + all turns)")
    scoring: Literal["outcome", "expected"] = Field(
        "outcome", description="outcome: the game reward; expected: V*(s0) minus the regret of each decision"
    )
    format_bonus: float = Field(0.0, description="added for well-formed answers (share of valid answers)")
    invalid_retries: int = Field(0, ge=0, le=16, description="re-prompts after an invalid answer before it forfeits")
    thinking: bool = Field(False, description="the model reasons in <think>...</think> before its call")
    think_budget: int = Field(192, ge=0, description="extra new tokens per turn for reasoning in thinking mode")


class GroupConfig(_Section):
    group_size: int = Field(16, ge=1, le=1024, description="episodes per group, all on one deal")
    drop_equal_scores: bool = Field(False, description="drop groups whose scores are all equal (no GRPO signal)")
    concurrency: int = Field(64, ge=1, description="episodes played at once")
    group_by: Literal["episode", "step"] = Field(
        "episode", description="episode: whole episodes on one deal; step: one group per decision, scored by Q*"
    )
    continue_with: Literal["sampled", "best"] = Field(
        "sampled", description="step groups: the answer the canonical episode continues with"
    )
    token_advantages: bool = Field(
        False, description="also emit per-token `advantages`: format tokens carry validity credit, the action token "
                           "the decision's Q* credit (see docs/api.md)")
    counterfactual: bool = Field(
        False, description="step groups: also add both valid calls, forced, scored by Q* with the policy's own "
                           "logprobs (exact all-action gradient); implies token advantages")
    scale_decisions: bool = Field(
        False, description="token advantages: divide each decision's credit by |Q*(hit) - Q*(stick)| (floored at "
                           "0.05), as GRPO divides a group by its spread, so every state weighs the same")
    format_weight: float = Field(
        1.0, ge=0.0, le=100.0, description="token advantages: weight of the validity credit on an answer's format "
                                           "tokens (0: train the decision only)")


class EvalConfig(_Section):
    episodes: int = Field(1000, ge=1)
    concurrency: int = Field(64, ge=1)
    samples: bool = Field(True, description="write every episode to samples.jsonl")
    grid: bool = Field(False, description="also the exact strategy chart from the policy's probabilities (grid.py)")


class ProcessConfig(_Section):
    groups: int = Field(8, ge=1)


class ServeConfig(_Section):
    api_url: str = Field("http://127.0.0.1:8000", description="the trajectory API")
    api_token: str | None = Field(None, description="bearer token of the API (or BLACKJACK_RL_SERVE__API_TOKEN)")
    env_name: str = "blackjack"
    worker_id: str | None = Field(None, description="names this worker: mixed into the deal seeds so workers play "
                                                     "different deals; a restart with the same id continues its deals "
                                                     "and takes over its API registration (default: host and process id)")
    weight: float = Field(1.0, description="this environment's share of each batch (Atropos env weight)")
    min_batch_allocation: float | None = Field(None, ge=0.0, le=1.0)
    max_batches_offpolicy: int = Field(3, ge=1, description="batches of groups kept queued or in flight ahead of the trainer")
    steps_per_eval: int = Field(100, ge=0, description="evaluate every N trainer steps (0: never)")
    eval_episodes: int = Field(200, ge=1)
    max_groups: int | None = Field(None, ge=1, description="stop after sending this many groups")
    register_timeout: float | None = Field(None, gt=0, description="give up waiting for the trainer after N s")
    drain_timeout: float = Field(60.0, ge=0, description="on SIGTERM, seconds to finish groups in flight")
    poll_interval: float = Field(1.0, gt=0)


class RayConfig(_Section):
    """`--ray`: evaluate / process in shards on a Ray cluster, serve workers as Ray actors (the `ray` extra)."""

    address: str | None = Field(None, description="the cluster: auto (the one `ray start` runs here), HOST:PORT, "
                                                   "or local (start one for this command); None: no Ray")
    actors: int | None = Field(None, ge=1, description="evaluate/process: shard actors (default: cluster CPUs / cpus)")
    cpus: float = Field(1.0, gt=0, description="CPUs reserved per actor (also its llama.cpp/torch threads)")
    workers: int = Field(1, ge=1, le=1024, description="serve: worker actors, each with its own worker id and deals")
    max_restarts: int = Field(100, ge=0, description="serve: restarts of one worker before the command gives up")


class TrainConfig(_Section):
    """`blackjack-rl train`: GRPO on the torch policy (needs the `train` extra)."""

    source: Literal["local", "api"] = Field(
        "local", description="local: play groups with the model being trained; api: pull batches from the trajectory API")
    steps: int = Field(50, ge=1, description="optimizer steps")
    deals_per_step: int = Field(4, ge=1, description="local: deals played per step (one group each, or one per decision)")
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    clip_eps: float = Field(0.2, gt=0, description="PPO clip of the importance ratio")
    kl_coef: float = Field(0.0, ge=0, description="weight of the KL to the initial model (0: no reference model)")
    scale_advantages: bool = Field(True, description="divide advantages by the group's score std (GRPO)")
    updates_per_batch: int = Field(1, ge=1, description="optimizer steps on each batch (>1 makes later ones off-policy)")
    lora: bool = Field(False, description="train LoRA adapters (peft) instead of every weight")
    lora_rank: int = Field(16, ge=1)
    lora_alpha: float = Field(32.0, gt=0)
    train_layers: int | None = Field(None, ge=1, description="train only the top N decoder layers (cheaper backward)")
    max_batch: int = Field(64, ge=1, description="answers sampled in one batch")
    eval_every: int = Field(10, ge=0, description="evaluate every N steps (0: only before and after)")
    eval_episodes: int = Field(200, ge=0, description="fixed evaluation deals per evaluation (0: no evaluation)")
    save_every: int = Field(0, ge=0, description="checkpoint every N steps (0: only the final model)")
    grid_every: int = Field(1, ge=0, description="exact strategy-chart evaluation every N steps (0: only with "
                                                 "the sampled evaluations)")
    resume: Path | None = Field(None, description="continue from a checkpoint folder (weights, optimizer, step, "
                                                  "deal stream)")
    max_minutes: float | None = Field(None, gt=0, description="stop training after this long (then evaluate and save)")
    api_url: str = Field("http://127.0.0.1:8000", description="api: the trajectory API")
    api_token: str | None = Field(None, description="api: bearer token (or BLACKJACK_RL_TRAIN__API_TOKEN)")
    batch_size: int | None = Field(None, ge=1, description="api: sequences per batch (default deals_per_step x group_size)")
    batch_timeout: float = Field(600.0, gt=0, description="api: seconds to wait for a batch")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="BLACKJACK_RL_", env_nested_delimiter="__", extra="forbid", nested_model_default_partial_update=True,
        allow_inf_nan=False,
    )

    seed: int = Field(0, description="base seed: fixes the deals (process) and sampling seeds")
    out: Path = Field(Path("runs/latest"), description="output folder")
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
        raise FileNotFoundError(f"config file {config_file} does not exist")

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
