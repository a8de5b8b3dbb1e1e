"""Every command's flags come from the settings models: each field a command exposes has a flag
that shows the model's default and choices, a value given on the command line reaches the
resolved settings, and a bad value is one line and exit 2.

The expectations here are read from the models directly (their fields, Literal types, bounds and
defaults), so a field added to a section a command exposes is checked without touching this file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
import pytest
from pydantic import BaseModel, SecretStr

from blackjack_rl import cli
from blackjack_rl.api import cli as api_cli
from blackjack_rl.api.settings import ApiConfig
from blackjack_rl.cli_options import Option, options_of, subcommands
from blackjack_rl.config import Settings
from blackjack_rl.train.cli import train_settings

CLI = [sys.executable, "-m", "blackjack_rl.cli"]
MAIN = cli.build_parser()
API = api_cli.build_parser()


def parser_of(command: str):
    return API if command == "api" else subcommands(MAIN)[command]


COMMANDS = sorted(subcommands(MAIN))
WITH_SETTINGS = [c for c in COMMANDS if options_of(parser_of(c))]


@pytest.fixture(autouse=True)
def no_settings_from_the_environment(monkeypatch):
    for name in os.environ:
        if name.startswith("BLACKJACK_RL_"):
            monkeypatch.delenv(name)


def test_the_commands_that_take_settings():
    """A command that plays, serves or trains exposes settings; `api` always does."""
    assert {"solve", "process", "evaluate", "grid", "serve", "train", "api"} <= set(WITH_SETTINGS)
    assert set(cli.SETTINGS) | {"api"} == set(WITH_SETTINGS)


# -- the model side, read without the code under test ---------------------------------------------

def _bare(annotation: Any) -> Any:
    if get_origin(annotation) is Union or type(annotation).__name__ == "UnionType":
        args = [a for a in get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _leaves(model: type[BaseModel], prefix: tuple[str, ...] = ()):
    for name, field in model.model_fields.items():
        kind = _bare(field.annotation)
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            yield from _leaves(kind, (*prefix, name))
        else:
            yield (*prefix, name), field


def exposed(command: str) -> dict[tuple[str, ...], Any]:
    """The fields a command declares, expanded to leaves: what must have a flag."""
    if command == "api":
        return dict(_leaves(ApiConfig))
    every = dict(_leaves(Settings))
    names = [tuple(n.split(".")) for n in cli.SETTINGS[command]]
    without = [tuple(n.split(".")) for n in cli.WITHOUT.get(command, ())]
    return {path: field for path, field in every.items()
            if any(path[:len(n)] == n for n in names) and not any(path[:len(n)] == n for n in without)}


def _shown(field, scale: float | None) -> str | None:
    default = field.get_default(call_default_factory=True)
    if default is None or isinstance(default, bool) or default == []:
        return None
    if scale:
        default = default / scale
    return f"{default:g}" if isinstance(default, float) else str(default)


def _action(parser, flag: str):
    return next(a for a in parser._actions if flag in a.option_strings)


# -- every exposed field has a flag, with the model's default and choices -------------------------

@pytest.mark.parametrize("command", WITH_SETTINGS)
def test_every_exposed_field_has_a_flag_with_the_models_default_and_choices(command):
    parser = parser_of(command)
    fields = exposed(command)
    options = options_of(parser)
    covered = {path for option in options for path in option.paths}
    assert covered == set(fields), f"fields without a flag: {set(fields) - covered}; flags without a field: " \
                                   f"{covered - set(fields)}"
    for option in options:
        action = _action(parser, option.flag)
        for path in option.paths:
            field = fields[path]
            assert field.description, f"{'.'.join(path)} has no description for {option.flag}'s help"
            help_text = " ".join(action.help.split()).replace("%%", "%")
            assert " ".join(field.description.split()) in help_text, option.flag
            shown = _shown(field, (field.json_schema_extra or {}).get("scale"))
            if shown is not None:
                assert f"(default {shown})" in help_text or f"Default: {shown}." in help_text, (option.flag, help_text)
            kind = _bare(field.annotation)
            if get_origin(kind) is Literal:
                assert list(action.choices) == list(get_args(kind)), option.flag
            else:
                assert action.choices is None, option.flag
            if kind is bool:  # a switch: on when off by default, else --no-...
                assert action.nargs == 0 and action.const is (not field.default), option.flag


@pytest.mark.parametrize("command", COMMANDS + ["api"])
def test_flags_are_named_once_per_command(command):
    parser = parser_of(command)
    flags = [s for a in parser._actions for s in a.option_strings]
    assert len(flags) == len(set(flags))


# -- a value given on the command line reaches the resolved settings ------------------------------

def _bounds(field) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in field.metadata:
        for key in ("ge", "gt", "le", "lt"):
            if isinstance(m, getattr(annotated_types, key.capitalize())):
                out[key] = getattr(m, key)
    return out


def _number(field, kind: type) -> float:
    """A valid value other than the default."""
    default = field.get_default(call_default_factory=True)
    b = _bounds(field)
    if kind is int:
        base = default if isinstance(default, int) else int(b.get("ge", b.get("gt", 0) + 1))
        value = base + 1
        return value if value <= b.get("le", value) and value < b.get("lt", value + 1) else base - 1
    return default / 2 if default else min(0.5, b.get("le", 1.0) / 2, b.get("lt", 1.0) / 2)


def sample(option: Option, field) -> tuple[list[str], Any]:
    """Command-line words for the option and the value the field must then hold."""
    kind = _bare(field.annotation)
    extra = field.json_schema_extra or {}
    if kind is bool:
        return [option.flag], not field.default
    if get_origin(kind) is Literal:
        choice = [c for c in get_args(kind) if c != field.default][-1]
        return [option.flag, str(choice)], choice
    if get_origin(kind) is list:
        return [option.flag, "http://127.0.0.1:9/v1"], ["http://127.0.0.1:9/v1"]
    if "scale" in extra:
        return [option.flag, "3"], int(3 * extra["scale"])
    if kind in (int, float):
        value = _number(field, kind)
        return [option.flag, str(value)], value
    if option.flag.endswith("-url"):
        return [option.flag, "http://127.0.0.1:9/a-value"], "http://127.0.0.1:9/a-value"
    return [option.flag, "a-value"], "a-value"


def resolve(command: str, args):
    if command == "api":
        return api_cli.config_from_args(args)
    settings = cli.settings_from_args(args)
    return train_settings(settings) if command == "train" else settings


def _at(settings, path):
    for key in path:
        settings = getattr(settings, key)
    if isinstance(settings, SecretStr):
        return settings.get_secret_value()
    if isinstance(settings, Path):
        return str(settings)
    if isinstance(settings, list):
        return [getattr(item, "url", item) for item in settings]
    return settings


# Flags whose other values are only valid together with another flag (the models' validators).
NEEDS = {"--starts": ["--credit", "step"], "--decisions": ["--credit", "step"], "--continue-with": ["--credit", "step"],
         "--balance-actions": ["--credit", "step"], "--balance-later": ["--credit", "step", "--balance-actions"],
         "--scale-decisions": ["--credit", "step-tokens"],
         "--format-weight": ["--credit", "step-tokens"], "--rollouts": ["--credit", "step-rollouts"],
         "--rollout-continuation": ["--credit", "step-rollouts"],
         "--rollout-refresh": ["--credit", "step-rollouts", "--rollout-continuation", "chart"],
         "--forced-weight": ["--credit", "step-counterfactual"],
         "--format-credit": ["--credit", "step-counterfactual"],
         "--balance-by": ["--credit", "step-counterfactual", "--balance-actions"],
         "--init-adapter": ["--lora"], "--base-adapter": ["--lora"]}
# The positional arguments a command needs besides its flags.
POSITIONAL = {"compare": ["runs/a", "runs/b"], "fidelity": ["groups.jsonl"]}


@pytest.mark.parametrize("command", WITH_SETTINGS)
def test_a_flag_value_reaches_the_resolved_settings(command):
    fields = exposed(command)
    parse = API.parse_args if command == "api" else (
        lambda words: MAIN.parse_args([command, *POSITIONAL.get(command, []), *words]))
    for option in options_of(parser_of(command)):
        words, expected = sample(option, fields[option.paths[0]])
        words = [*words, *NEEDS.get(option.flag, [])]
        settings = resolve(command, parse(words))
        for path in option.paths:
            assert _at(settings, path) == expected, (command, words, path)


def test_flags_left_out_keep_the_defaults():
    assert cli.settings_from_args(MAIN.parse_args(["evaluate"])).model_dump() == Settings().model_dump()
    assert api_cli.config_from_args(API.parse_args([])) == ApiConfig()


# -- a bad value is one line and exit 2, through the real command line ----------------------------

def _bad_values(command: str) -> list[tuple[str, list[str], str]]:
    """(case, words, what the one line must name) for a command: a value of the wrong type and a
    value out of the model's bounds, where it has such flags; else a flag it does not have."""
    options = options_of(parser_of(command))
    fields = exposed(command) if options else {}
    cases = []
    typed = [o for o in options if _bare(fields[o.paths[0]].annotation) in (int, float)
             and "scale" not in (fields[o.paths[0]].json_schema_extra or {})]
    if typed:
        cases.append(("not a number", [typed[0].flag, "many"], typed[0].flag))
    bounded = [o for o in typed if _bounds(fields[o.paths[0]])]
    if bounded:
        o = bounded[-1]
        b = _bounds(fields[o.paths[0]])
        value = b["le"] + 1 if "le" in b else b["lt"] if "lt" in b else b["ge"] - 1 if "ge" in b else b["gt"]
        cases.append(("out of bounds", [o.flag, str(value)], o.flag))
    if not cases:
        cases.append(("unknown flag", ["--no-such-flag"], f"blackjack-rl {command} --help"))
    return cases


BAD = [(command, *case) for command in COMMANDS for case in _bad_values(command)]


@pytest.mark.parametrize(("command", "case", "words", "named"), BAD, ids=[f"{c[0]}-{c[1]}" for c in BAD])
def test_a_bad_value_is_one_line_and_exit_2(command, case, words, named, tmp_path):
    extra = POSITIONAL.get(command, [])
    proc = subprocess.run([*CLI, command, *extra, *words], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={k: v for k, v in os.environ.items() if not k.startswith("BLACKJACK_RL_")})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and named in lines[0], lines
    assert not any(tmp_path.iterdir()), "a refused command wrote something"


# -- the command lines the README and docs show still parse ---------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def documented_command_lines() -> list[tuple[str, list[str]]]:
    """`blackjack-rl ...` lines of the Markdown code blocks (continuations joined, comments, pipes
    and a trailing `...` cut off), with the file they are in."""
    import re
    import shlex

    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for block in re.findall(r"```[\w-]*\n(.*?)```", path.read_text(encoding="utf-8"), re.S):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                match = re.search(r"(?:^|\s)blackjack-rl (\w.*)$", line.strip())
                if match is None or line.strip().startswith("#"):
                    continue
                words = shlex.split(match.group(1), comments=True)
                cut = [i for i, w in enumerate(words) if w in ("...", "|", "&&", ">", "&")]
                found.append((str(path.relative_to(ROOT)), words[:cut[0]] if cut else words))
    return found


def test_every_command_line_in_the_docs_parses():
    lines = documented_command_lines()
    assert len(lines) > 20 and {words[0] for _, words in lines} >= {"evaluate", "process", "serve", "train", "api"}
    for where, words in lines:
        try:
            if words[0] == "api":
                API.parse_args(words[1:])
            else:
                MAIN.parse_args(words)
        except SystemExit:
            pytest.fail(f"{where}: `blackjack-rl {' '.join(words)}` no longer parses")
