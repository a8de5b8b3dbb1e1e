"""`train --recipe`: every phase of a recipe, chained, resumable, then one before/after report.

What a run leaves in `--out`:
    recipe.yaml      the recipe as the run read it (a resumed run reads this copy, not the package's)
    run.json         the recipe's name, version and signal; the run's seed and threads
    NN-NAME/         each phase's trainer folder (trainer.py), with phase.json once the phase is done
    report/before/   `evaluate` of the model the run started from
    report/after/    `evaluate` of the trained model, on the same fixed deals
    report/compare/  the two paired by deal (compare.html, compare.json)
    report.json      written last: its presence says the run is complete

A killed run resumes (`train --resume OUT`) at the last checkpoint of the phase it was in: the
log is cut back to that step, and the trainer restores weights, optimizer, deal stream and
random state, so the next step is the one the whole run would have taken.
"""

from __future__ import annotations

import gc
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from blackjack_rl.config import GroupConfig, PolicyConfig, Settings
from blackjack_rl.outputs import prepare_folder, write_text
from blackjack_rl.train.recipe import Recipe, parse_recipe, phase_settings

RECIPE, RUN, DONE, REPORT = "recipe.yaml", "run.json", "phase.json", "report.json"


@dataclass(frozen=True)
class RecipeRun:
    """A recipe run's folder and what fixed it when it started."""

    out: Path
    recipe: Recipe
    seed: int
    threads: int | None

    def phase(self, index: int, previous: Path | None) -> Settings:
        return phase_settings(self.recipe, index, out=self.out, seed=self.seed, previous=previous,
                              threads=self.threads)

    def folder(self, index: int) -> Path:
        return self.out / self.recipe.phase_dir(index)


def start_run(text: str, source: str, out: Path, seed: int, threads: int | None) -> RecipeRun:
    """A new run in `out`; refuses a folder that already holds one (resume it instead)."""
    recipe = parse_recipe(text, source)
    if (out / RECIPE).exists():
        raise ValueError(f"{out} already holds a recipe run: continue it with `blackjack-rl train --resume {out}`, "
                         "or choose another --out")
    prepare_folder(out)
    write_text(out / RECIPE, text)
    write_text(out / RUN, json.dumps({"recipe": recipe.name, "version": recipe.version, "signal": recipe.signal,
                                      "seed": seed, "threads": threads}, indent=2) + "\n")
    return RecipeRun(out, recipe, seed, threads)


def is_recipe_run(path: Path) -> bool:
    return (path / RECIPE).is_file() and (path / RUN).is_file()


def open_run(out: Path) -> RecipeRun:
    """The run in `out`, as it started."""
    if not is_recipe_run(out):
        raise FileNotFoundError(f"{out} is not a recipe run (no {RECIPE} and {RUN})")
    meta = json.loads((out / RUN).read_text(encoding="utf-8"))
    recipe = parse_recipe((out / RECIPE).read_text(encoding="utf-8"), str(out / RECIPE))
    return RecipeRun(out, recipe, int(meta["seed"]), meta.get("threads"))


def latest_checkpoint(folder: Path) -> Path | None:
    """The phase's last checkpoint that holds trainer state (one cut short by a kill has none)."""
    found = sorted((folder / "checkpoints").glob("step_*/trainer_state.pt"))
    return found[-1].parent if found else None


def cut_log(log: Path, step: int) -> None:
    """Keep the rows of steps up to `step`: the resumed phase writes the later ones again."""
    if not log.is_file():
        return
    rows = [line for line in log.read_text(encoding="utf-8").splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    write_text(log, "".join(row + "\n" for row in rows))


def stop_rule(run: RecipeRun, index: int) -> Callable[[dict[str, Any]], str | None] | None:
    rule = run.recipe.phases[index].stop_when
    if rule is None:
        return None

    def check(row: dict[str, Any]) -> str | None:
        value = row.get(rule.metric)
        if value is not None and value >= rule.at_least:
            return f"stop_when {rule.metric} {value:.4f} >= {rule.at_least}"
        return None

    return check


def plan(run: RecipeRun) -> list[Settings]:
    """Every phase's settings, chained as the run will chain them."""
    out, previous = [], None
    for i in range(len(run.recipe.phases)):
        out.append(run.phase(i, previous))
        previous = run.folder(i)
    return out


def run_phases(run: RecipeRun, argv: list[str], progress: Callable[[str], None]) -> Path:
    """Train every phase not yet done, each from the previous one's model; returns the last phase's folder."""
    from blackjack_rl.rollout.players import build_player
    from blackjack_rl.train.trainer import run_training

    phases, total = run.recipe.phases, sum(p.steps for p in run.recipe.phases)
    previous: Path | None = None
    first_step = 1
    for i, phase in enumerate(phases):
        folder = run.folder(i)
        label = f"[{i + 1}/{len(phases)} {phase.name}, steps {first_step}-{first_step + phase.steps - 1} of {total}]"
        first_step += phase.steps
        if (folder / DONE).is_file():
            progress(f"{label} done earlier")
            previous = folder
            continue
        settings = run.phase(i, previous)
        checkpoint = latest_checkpoint(folder)
        if checkpoint is not None:
            from blackjack_rl.train.checkpoints import load_trainer_state

            cut_log(folder / "train_log.jsonl", int(load_trainer_state(checkpoint)["step"]))
            settings = settings.model_copy(update={"train": settings.train.model_copy(update={"resume": checkpoint})})
        player = build_player(settings)
        result = run_training(settings, player, argv, progress=lambda line, p=label: progress(f"{p} {line}"),
                              stop=stop_rule(run, i))
        write_text(folder / DONE, json.dumps({"phase": phase.name, "steps": result.steps,
                                              "stopped": result.stopped}, indent=2) + "\n")
        del player, result
        gc.collect()
        previous = folder
    assert previous is not None
    return previous


def evaluation_settings(first: Settings, out: Path, trained: Path | None, episodes: int, grid: bool) -> Settings:
    """`evaluate` of the model phase 1 starts from, or with `trained` (the last phase's folder) of
    the trained one: llama.cpp for a GGUF base with the adapter applied, else the torch model."""
    p = first.policy
    gguf = p.model_path is None or p.model_path.endswith(".gguf")
    lora = first.train.lora and trained is not None
    policy = PolicyConfig(
        kind="embedded" if gguf else "hf", temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        max_tokens=p.max_tokens, n_threads=p.n_threads,
        model_path=p.model_path if trained is None or (gguf and lora) else str(trained / ("adapter" if lora else "model")),
        lora=str(trained / "adapter") if gguf and lora else None,
    )
    if trained is not None and gguf and not lora:
        raise ValueError("the report plays a fully trained model with the torch policy: set policy.model_path to a "
                         "model folder, or train with LoRA")
    return first.model_copy(update={
        "out": out, "seed": 0, "policy": policy, "groups": GroupConfig(concurrency=first.groups.concurrency),
        "evaluate": first.evaluate.model_copy(update={"episodes": episodes, "grid": grid, "samples": True}),
    })


def report(run: RecipeRun, last: Path, quiet: bool, console: Any) -> Path:
    """The starting model and the trained one on the same fixed deals, paired; report.json last."""
    from blackjack_rl.jobs.compare import run_versus
    from blackjack_rl.jobs.evaluate import evaluate_settings
    from blackjack_rl.report.console import print_comparison

    first, r = run.phase(0, None), run.recipe.report
    runs = [evaluation_settings(first, run.out / "report" / name, last if name == "after" else None, r.episodes,
                                r.grid) for name in ("before", "after")]
    played: dict[str, Any] = {}
    compared = run_versus(runs, run.out / "report" / "compare",
                          lambda s: played.setdefault(Path(s.out).name, evaluate_settings(s, progress=not quiet)))
    print_comparison(compared.runs, compared.comparisons, console)
    summary = {"recipe": run.recipe.name, "version": run.recipe.version, "signal": run.recipe.signal, "seed": run.seed,
               **{name: {"folder": f"report/{name}", "policy": m.policy} for name, m in played.items()},
               "compare": "report/compare/compare.json"}
    write_text(run.out / REPORT, json.dumps(summary, indent=2) + "\n")
    return compared.page
