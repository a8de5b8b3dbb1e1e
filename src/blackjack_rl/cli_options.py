"""Command-line flags derived from the pydantic settings models.

A setting is declared once, as a model field: its type, bounds, default and description.
Its flag, its choices, its help and the default that help shows are read from that field,
so a flag cannot drift from the setting it sets, and a new field of a section a command
exposes gets its flag without further code. A command says which fields it exposes
(`select`); `add_options` turns them into argparse options, and `given` turns a parsed
command line back into the nested settings it gives.

The flag is `--field-name`, a `False` bool a `--field-name` switch, a `True` bool a
`--no-field-name` switch. A field's `json_schema_extra` may adjust this, for flags whose
names predate the field's:
    flag     the flag's name, e.g. "--policy" for `policy.kind`
    metavar  the value's name in the usage line, e.g. "PATH"
    const    the value of the flag given bare (the flag then takes an optional value)
    scale    the field holds the flag's value times this, e.g. MiB for a flag in MB
Fields that share a flag name within one command (`groups.concurrency` and
`evaluate.concurrency`) are one flag that sets them all.
"""

from __future__ import annotations

import argparse
import types
from dataclasses import dataclass
from typing import Any, Iterable, Literal, NoReturn, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined


class Parser(argparse.ArgumentParser):
    """A parser whose usage errors are one line: the usage of a command with fifty flags would bury
    the message. `--help` still shows it all. No abbreviations: `train --model X` must not quietly
    mean `--model-path X`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


# Where a subcommand's parser leaves its options in the parsed namespace (see `given`).
_OPTIONS = "_settings_options"

FieldPath = tuple[str, ...]  # e.g. ("policy", "temperature")


@dataclass(frozen=True)
class Option:
    """One flag and the settings fields it sets (more than one when fields share the flag)."""

    flag: str
    paths: tuple[FieldPath, ...]
    field: FieldInfo
    section: str | None  # the top-level section, which titles the flag's help group
    section_doc: str | None

    @property
    def dest(self) -> str:
        return "__".join(self.paths[0])

    @property
    def extra(self) -> dict[str, Any]:
        extra = self.field.json_schema_extra
        return extra if isinstance(extra, dict) else {}

    @property
    def kind(self) -> Any:
        """The field's type without `| None`."""
        return _without_none(self.field.annotation)

    @property
    def choices(self) -> list[Any] | None:
        return list(get_args(self.kind)) if get_origin(self.kind) is Literal else None

    @property
    def default(self) -> Any:
        if self.field.default_factory is not None:
            return self.field.default_factory()  # type: ignore[call-arg]
        return None if self.field.default is PydanticUndefined else self.field.default

    def shown_default(self) -> str | None:
        """The model's default as the help shows it; None where there is nothing to show (None, an
        empty list, a switch: there the description says what happens)."""
        default = self.default
        if default is None or self.kind is bool or default == []:
            return None
        if "scale" in self.extra:
            default = default / self.extra["scale"]
        return f"{default:g}" if isinstance(default, float) else str(default)

    def value(self, given: Any) -> Any:
        """The field's value for the flag's value."""
        scale = self.extra.get("scale")
        if scale is None or given is None:
            return given
        value = given * scale
        return int(value) if self.kind is int else value

    def argparse_kwargs(self) -> dict[str, Any]:
        # default None everywhere: a flag not given sets nothing, so YAML, environment and
        # model defaults stay in force (config.load_settings merges them)
        kw: dict[str, Any] = {"dest": self.dest, "default": None, "help": self.help()}
        kind = self.kind
        if kind is bool:
            kw["action"] = "store_false" if self.default is True else "store_true"
            return kw
        choices = self.choices
        if choices is not None:
            kw["choices"] = choices
            kw["type"] = type(choices[0])
        elif get_origin(kind) is list:
            kw["action"] = "append"
            item = get_args(kind)[0] if get_args(kind) else str
            kw["type"] = item if item in (int, float) else str  # pydantic parses the rest
        elif "scale" in self.extra:
            kw["type"] = float
        elif kind in (int, float):
            kw["type"] = kind
        if "const" in self.extra:
            kw["nargs"] = "?"
            kw["const"] = self.extra["const"]
        if choices is None:
            kw["metavar"] = self.extra.get("metavar", self.flag.lstrip("-").replace("-", "_").upper())
        return kw

    def help(self) -> str:
        text = self.field.description or ""
        if self.kind is bool and self.default is True:
            text = f"turn off (on by default): {text}"
        shown = self.shown_default()
        if shown is not None:
            text += f" Default: {shown}." if text.endswith(".") else f" (default {shown})"
        return text.replace("%", "%%")  # argparse formats help with %


def _without_none(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _is_section(annotation: Any) -> bool:
    kind = _without_none(annotation)
    return isinstance(kind, type) and issubclass(kind, BaseModel)


def _flag_of(name: str, field: FieldInfo) -> str:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if "flag" in extra:
        return str(extra["flag"])
    prefix = "--no-" if _without_none(field.annotation) is bool and field.default is True else "--"
    return prefix + name.replace("_", "-")


def select(model: type[BaseModel], include: Iterable[str], exclude: Iterable[str] = ()) -> tuple[Option, ...]:
    """The options for the fields `include` names in `model`: "seed" (one field), "policy" (every
    field of a section, nested sections included), "groups.concurrency" (one field of a section);
    minus those under an `exclude` name."""
    excluded = [tuple(name.split(".")) for name in exclude]
    by_flag: dict[str, Option] = {}
    for name in include:
        for path, field, section_doc in _leaves(model, tuple(name.split("."))):
            if any(path[: len(x)] == x for x in excluded):
                continue
            option = Option(_flag_of(path[-1], field), (path,), field, path[0] if len(path) > 1 else None, section_doc)
            known = by_flag.get(option.flag)
            if known is None:
                by_flag[option.flag] = option
            elif path not in known.paths:
                if (known.kind, known.default) != (option.kind, option.default):
                    raise TypeError(f"{option.flag} would set {'.'.join(known.paths[0])} and {'.'.join(path)}, "
                                    "which differ in type or default")
                by_flag[option.flag] = Option(known.flag, (*known.paths, path), known.field, known.section,
                                              known.section_doc)
    return tuple(by_flag.values())


def _leaves(model: type[BaseModel], path: FieldPath, at: FieldPath = (),
            doc: str | None = None) -> Iterable[tuple[FieldPath, FieldInfo, str | None]]:
    """The leaf fields at `path` below `model` (a section expands to its fields), each with the
    docstring of the top-level section it is in."""
    if not path:
        for name in model.model_fields:
            yield from _leaves(model, (name,), at, doc)
        return
    field = model.model_fields.get(path[0])
    if field is None:
        raise KeyError(f"{model.__name__} has no field {path[0]!r}")
    here = (*at, path[0])
    if _is_section(field.annotation):
        section = _without_none(field.annotation)
        yield from _leaves(section, path[1:], here, doc if at else section.__dict__.get("__doc__"))
        return
    if len(path) > 1:
        raise KeyError(f"{model.__name__}.{path[0]} is not a section")
    yield here, field, doc


def add_options(parser: argparse.ArgumentParser, options: Iterable[Option]) -> None:
    """Add the options' flags, each section's under its own heading, and remember them for `given`."""
    options = tuple(options)
    groups: dict[str, Any] = {}
    for option in options:
        target: Any = parser
        if option.section is not None:
            if option.section not in groups:
                doc = " ".join((option.section_doc or "").split()) or None
                groups[option.section] = parser.add_argument_group(option.section, doc)
            target = groups[option.section]
        target.add_argument(option.flag, **option.argparse_kwargs())
    parser.set_defaults(**{_OPTIONS: (*(parser.get_default(_OPTIONS) or ()), *options)})


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """A parser's subcommands by name (none if it has none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def options_of(parsed: argparse.Namespace | argparse.ArgumentParser) -> tuple[Option, ...]:
    """The settings options of a command's parser, or of the command that parsed these args."""
    if isinstance(parsed, argparse.ArgumentParser):
        return parsed.get_default(_OPTIONS) or ()
    return getattr(parsed, _OPTIONS, None) or ()


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the command line gives, nested as the model is. A flag not given is absent,
    so it overrides nothing."""
    out: dict[str, Any] = {}
    for option in options_of(args):
        value = getattr(args, option.dest, None)
        if value is None:
            continue
        for path in option.paths:
            node = out
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = option.value(value)
    return out


def validation_error(exc: ValidationError, options: Iterable[Option] = ()) -> str:
    """A ValidationError in one line: each bad setting by name, with its flag where the command has one."""
    flags = {path: option.flag for option in options for path in option.paths}
    parts = []
    for error in exc.errors(include_url=False):
        loc = tuple(str(part) for part in error["loc"])
        flag = next((flags[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in flags), None)
        name = ".".join(loc) or "settings"
        # a validator's own ValueError says what is wrong in full; pydantic prefixes it "Value error, "
        msg = str(error["ctx"]["error"]) if error["type"] == "value_error" and "error" in error.get("ctx", {}) \
            else error["msg"]
        parts.append(f"{name}{f' ({flag})' if flag else ''}: {msg}")
    return "; ".join(parts)

