"""What is derived from the declarations: argparse flags, configs from parsed flags, a
worker's argv, plain dicts, and the docs' Markdown tables."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

from radixserve.options.declare import Option, applies_to, help_text, options_of, type_copy

T = TypeVar("T")


def add_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    command: str | None = None,
    *,
    skip: Iterable[str] = (),
) -> None:
    """Add a flag for each option of `cls` that `command` takes (all when None), except the
    fields named in `skip`. The parsed value lands on the namespace under the field's name."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    skipped = set(skip)
    for opt in options_of(cls):
        if opt.name in skipped or not applies_to(opt, command):
            continue
        target: Any = parser
        if opt.group and isinstance(parser, argparse.ArgumentParser):
            if opt.group not in groups:
                groups[opt.group] = parser.add_argument_group(opt.group)
            target = groups[opt.group]
        names = [opt.flag] + ([opt.short] if opt.short else [])
        kw: dict[str, Any] = {"dest": opt.name, "help": help_text(opt, command)}
        default = opt.default_for(command)
        if opt.env and os.environ.get(opt.env):
            default = os.environ[opt.env]
        if opt.is_switch:
            kw["action"] = "store_false" if default else "store_true"
            kw["default"] = default
        else:
            kw.update(type=opt.type, choices=opt.choices, metavar=opt.metavar)
            kw["default"] = type_copy(default) if isinstance(default, (list, dict)) else default
            if opt.repeat:
                kw["action"] = "append"
            if opt.nargs:
                kw["nargs"] = opt.nargs
        target.add_argument(*names, **kw)


def from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """An instance of config dataclass `cls` from parsed flags: fields the namespace lacks
    keep their declared defaults; `overrides` win."""
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if hasattr(args, f.name)
    }
    return cls(**{**values, **overrides})


def to_argv(config: Any, exclude: Iterable[str] = ()) -> list[str]:
    """Flags that rebuild `config` from its class's defaults (only options that differ and
    have a flag; `exclude` names fields to leave out)."""
    argv: list[str] = []
    excluded = set(exclude)
    for opt in options_of(type(config)):
        value = getattr(config, opt.name)
        if opt.flag is None or opt.name in excluded or value == opt.default:
            continue
        if opt.is_switch:
            argv.append(opt.flag)
        elif opt.repeat:
            for item in value:
                argv += [opt.flag, str(item)]
        elif opt.nargs:
            argv += [opt.flag, *(str(v) for v in value)]
        elif isinstance(value, (dict, list)):
            argv += [opt.flag, json.dumps(value)]
        else:
            argv += [opt.flag, str(value)]
    return argv


def to_dict(config: Any) -> dict[str, Any]:
    """`config`'s fields that differ from their defaults, as a JSON-able dict."""
    default = type(config)()
    return {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if getattr(config, f.name) != getattr(default, f.name)
    }


def from_dict(cls: type[T], values: Mapping[str, Any], what: str = "option") -> T:
    """`cls(**values)`, with unknown keys a ValueError that names them and the known ones
    ("unknown <what>(s): ...")."""
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(
            f"unknown {what}(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    return cls(**values)


def markdown_table(rows: Sequence[tuple[str, type, str | None]]) -> str:
    """A Markdown table of the options of each (title, class, command) row: flag, field,
    default, meaning (options without a flag too: they are keyword arguments). The docs'
    option tables are this function's output."""
    out: list[str] = []
    for title, cls, command in rows:
        out += [
            f"### {title}",
            "",
            "| flag | field | default | meaning |",
            "| --- | --- | --- | --- |",
        ]
        for opt in options_of(cls):
            if opt.flag is not None and not applies_to(opt, command):
                continue
            flag = "" if opt.flag is None else f"`{opt.flag}`"
            if opt.short:
                flag += f", `{opt.short}`"
            out.append(
                f"| {flag} | `{opt.name}` | {_default_cell(opt, command)} | {_meaning(opt)} |"
            )
        out.append("")
    return "\n".join(out)


def _default_cell(opt: Option, command: str | None) -> str:
    shown = opt.describe_default(command)
    if opt.is_switch:
        cell = f"`{opt.default}`"
    elif shown is None:
        cell = ""
    elif opt.default_text is not None and shown == opt.default_text:
        cell = f"*{shown}*"
    else:
        cell = f"`{shown}`"
    if opt.env:
        cell = f"`${opt.env}`" if not cell else f"{cell}, or `${opt.env}`"
    by_value: dict[str, list[str]] = {}
    for cmd, value in opt.command_defaults.items():
        by_value.setdefault(str(value), []).append(cmd)
    for value, cmds in by_value.items():
        cell += f"; `{value}` for {', '.join(cmds)}"
    return cell


def _meaning(opt: Option) -> str:
    text = opt.help.replace("|", "\\|")
    if opt.choices:
        text += ": " + ", ".join(f"`{c}`" for c in opt.choices)
    return text
