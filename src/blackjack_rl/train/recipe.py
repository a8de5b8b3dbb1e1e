"""Recipes: a committed, versioned file of training phases, each a settings overlay.

A recipe is the whole of how a shipped model was trained, so that one command reproduces it:
the settings every phase shares, then each phase's own, in the sections of a `--config` file.
The runner (train/pipeline.py) sets what chains the phases, and a recipe may not: each phase's
output folder, its steps, its seed (the run's seed plus the phase's), and the adapter it starts
from (the previous phase's). What would make a run depend on the machine is refused too: a
wall-clock limit, or groups pulled from an API another process feeds.

A phase ends after `steps` optimizer steps. `stop_when` may end it earlier on a measured
chart number; a recipe that uses it says so in its file, and the run logs which rule ended
each phase.
"""

from __future__ import annotations

from copy import deepcopy
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from blackjack_rl.config import Settings, load_settings

# What a recipe's credit comes from: the solver's exact Q* (imitation of the optimal chart),
# or the table's rewards alone, as any simulator gives them.
Signal = Literal["solver", "table"]

# Set by the runner for every phase, never by a recipe (see the module docstring).
RUNNER_SETS = {
    ("out",): "each phase writes to OUT/NN-NAME",
    ("seed",): "a phase's seed is the run's --seed plus the phase's `seed`",
    ("train", "steps"): "a phase's `steps` says how long it trains",
    ("train", "resume"): "resume a recipe run with `train --resume OUT`",
    ("train", "init_adapter"): "a phase starts from the previous phase's adapter (`start`)",
    ("train", "base_adapter"): "a phase starts from the previous phase's adapter (`start`)",
    ("train", "max_minutes"): "a wall-clock limit ends a phase at a different step on every machine: use `steps` "
                              "or `stop_when`",
    ("train", "source"): "a recipe plays its own groups, so that one command reproduces it",
    ("policy", "kind"): "train samples with the torch model it trains",
}

# Chart numbers (train/metrics.py grid_metrics) a phase may stop on.
StopMetric = Literal["grid_accuracy", "grid_cell_accuracy", "grid_value", "grid_p_calls", "grid_hit_gap"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StopRule(_Strict):
    """End the phase at the first chart (every `train.grid_every` steps) whose `metric` reaches `at_least`."""

    metric: StopMetric
    at_least: float


class Phase(_Strict):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,39}$")
    steps: int = Field(ge=1, le=100_000)
    seed: int = Field(0, ge=0, le=1_000_000)
    start: Literal["base-adapter", "init-adapter"] = Field(
        "base-adapter", description="LoRA: a fresh adapter over the previous phase's (base-adapter), or that adapter "
                                    "trained on (init-adapter); ignored by the first phase")
    stop_when: StopRule | None = None
    settings: dict[str, Any] = Field(default_factory=dict)


class Report(_Strict):
    """The before/after evaluation that ends a run: the starting model and the trained one on the
    same fixed deals, then paired by deal."""

    episodes: int = Field(1000, ge=1, le=100_000)
    grid: bool = True


class Recipe(_Strict):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,39}$")
    version: int = Field(ge=1)
    signal: Signal
    summary: str
    settings: dict[str, Any] = Field(default_factory=dict)
    phases: list[Phase] = Field(min_length=1, max_length=32)
    report: Report = Report()

    @model_validator(mode="after")
    def _phases(self) -> "Recipe":
        names = [p.name for p in self.phases]
        if len(set(names)) != len(names):
            raise ValueError(f"recipe {self.name}: phase names must differ, got {names}")
        for where, overlay in [("settings", self.settings)] + [(f"phase {p.name}", p.settings) for p in self.phases]:
            for path in leaf_paths(overlay):
                for fixed, why in RUNNER_SETS.items():
                    if path[: len(fixed)] == fixed:
                        raise ValueError(f"recipe {self.name}, {where}: {'.'.join(path)} is not a recipe's to set: {why}")
        return self

    def phase_dir(self, index: int) -> str:
        return f"{index + 1:02d}-{self.phases[index].name}"


def leaf_paths(tree: dict[str, Any], at: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for key, value in tree.items():
        here = (*at, str(key))
        out.extend(leaf_paths(value, here) if isinstance(value, dict) else [here])
    return out


def merged(*trees: dict[str, Any]) -> dict[str, Any]:
    """Later trees override earlier ones, section by section."""
    out: dict[str, Any] = {}
    for tree in trees:
        for key, value in tree.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merged(out[key], value)
            else:
                out[key] = deepcopy(value)
    return out


def shipped() -> list[str]:
    """The names of the recipes shipped in the package."""
    folder = resources.files("blackjack_rl.train") / "recipes"
    return sorted(f.name[:-5] for f in folder.iterdir() if f.name.endswith(".yaml"))


def recipe_text(name_or_file: str) -> tuple[str, str]:
    """The recipe's YAML text and where it came from: a file, or a shipped recipe by name."""
    path = Path(name_or_file)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"recipe file {path} does not exist")
        return path.read_text(encoding="utf-8"), str(path)
    if name_or_file not in shipped():
        raise ValueError(f"no recipe {name_or_file!r}: the shipped recipes are {', '.join(shipped())}, "
                         "or pass a recipe file (.yaml)")
    folder = resources.files("blackjack_rl.train") / "recipes"
    return (folder / f"{name_or_file}.yaml").read_text(encoding="utf-8"), f"recipe {name_or_file}"


def parse_recipe(text: str, source: str = "recipe") -> Recipe:
    """A recipe from its YAML text; every error is one line naming the source."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{source} is not valid YAML: {getattr(exc, 'problem', None) or exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{source} must hold a mapping (name:, version:, signal:, phases:, ...)")
    from pydantic import ValidationError

    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{source}: {where + ': ' if where else ''}{first['msg']}") from None
    _only_training_options(recipe)
    for i, phase in enumerate(recipe.phases):
        settings = phase_settings(recipe, i)  # every phase's settings are valid before anything runs
        if phase.stop_when is not None and not settings.train.grid_every:
            raise ValueError(f"recipe {recipe.name}, phase {phase.name}: stop_when reads the chart, which "
                             "train.grid_every 0 never draws")
        if recipe.signal == "table":
            _reward_only(recipe, phase, settings)
    return recipe


def _reward_only(recipe: Recipe, phase: Phase, settings: Settings) -> None:
    """A recipe whose signal is the table's rewards: no phase's credit, states, weights or end
    may come from the solver (groups.credit step-rollouts refuses the state choices itself)."""
    g, why = settings.groups, None
    if g.credit == "episode" and settings.episode.scoring != "outcome":
        why = f"episode.scoring {settings.episode.scoring} scores by V* and the regret of each decision"
    elif g.credit not in ("episode", "step-rollouts"):
        why = f"groups.credit {g.credit} credits decisions by Q*"
    elif phase.stop_when is not None:
        why = "stop_when ends the phase on the chart, which the solver measures"
    if why:
        raise ValueError(f"recipe {recipe.name}, phase {phase.name}: signal table takes only the table's rewards, "
                         f"but {why} (use groups.credit step-rollouts, or episode with outcome scoring)")


def _only_training_options(recipe: Recipe) -> None:
    """A recipe sets only what `train` takes: a setting that does nothing for training is an error."""
    from blackjack_rl.cli_options import select
    from blackjack_rl.train.cli import TRAIN_SETTINGS

    known = {path for option in select(Settings, TRAIN_SETTINGS) for path in option.paths}
    for where, overlay in [("settings", recipe.settings)] + [(f"phase {p.name}", p.settings) for p in recipe.phases]:
        for path in leaf_paths(overlay):
            if path not in known:
                raise ValueError(f"recipe {recipe.name}, {where}: {'.'.join(path)} is not a setting of train")


def phase_overrides(recipe: Recipe, index: int, *, out: Path = Path("runs/recipe"), seed: int = 0,
                    previous: Path | None = None, threads: int | None = None) -> dict[str, Any]:
    """What phase `index` runs with, as settings overrides: the recipe's shared settings, the
    phase's, and what the runner chains (`previous`: the previous phase's output folder)."""
    phase = recipe.phases[index]
    tree = merged(recipe.settings, phase.settings)
    chain: dict[str, Any] = {"out": str(out / recipe.phase_dir(index)), "seed": seed + phase.seed,
                             "policy": {"kind": "hf"}, "train": {"steps": phase.steps}}
    if threads is not None:
        chain["policy"]["n_threads"] = threads
    if previous is not None:
        if tree.get("train", {}).get("lora"):
            key = "base_adapter" if phase.start == "base-adapter" else "init_adapter"
            chain["train"][key] = str(previous / "adapter")
        else:
            chain["policy"]["model_path"] = str(previous / "model")
    return merged(tree, chain)


def phase_settings(recipe: Recipe, index: int, **chain: Any) -> Settings:
    """The resolved settings of phase `index` (one line naming the phase when they are invalid)."""
    from pydantic import ValidationError

    from blackjack_rl.cli_options import validation_error

    try:
        return load_settings(None, phase_overrides(recipe, index, **chain))
    except ValidationError as exc:
        raise ValueError(f"recipe {recipe.name}, phase {recipe.phases[index].name}: {validation_error(exc)}") from None


def effective(settings: Settings) -> dict[str, Any]:
    """The settings that differ from the defaults, nested by section: what --dry-run prints."""
    defaults = Settings.model_construct().model_dump(mode="json")

    def diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key, value in a.items():
            if isinstance(value, dict):
                sub = diff(value, b.get(key, {}))
                if sub:
                    out[key] = sub
            elif value != b.get(key):
                out[key] = value
        return out

    return diff(settings.model_dump(mode="json"), defaults)
