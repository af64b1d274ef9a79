"""Options, each declared once, and everything derived from that declaration.

An option is a field of a config dataclass (`EngineConfig`, `ServerConfig`, `RouteConfig`, ...)
declared with `option(default, help, ...)`. From the fields this module derives the command
line (`add_options`), the dataclass back from parsed flags (`from_args`), a worker's argv
(`to_argv`), plain dicts for Ray (`to_dict` / `from_dict`) and the docs' table
(`markdown_table`). A declaration never repeats its default in its help: `add_options` appends
it. The value types below parse one flag each (a bad value is an argparse error, exit 2);
nothing here imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from radixserve.values import (
    MAX_BLOCK_SIZE,
    device_name,
    kv_cache_dtype_name,
    parse_size,
)

T = TypeVar("T")
_META = "radixserve.option"

# -------------------------------------------------------------------------- value types


def memory_size(text: str) -> str:
    """A positive memory size (kept as text, so it can be passed on to worker processes)."""
    try:
        n = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size (e.g. 2GiB, 512MiB)")
    return text


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """A type: a whole number in [lo, hi] (no upper bound when hi is None)."""

    def parse(text: str) -> int:
        value = _int(text)
        if value < lo or (hi is not None and value > hi):
            bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
            raise argparse.ArgumentTypeError(f"{value} is out of range: must be {bound}")
        return value

    return parse


def float_in(lo: float, hi: float | None = None, lo_open: bool = False) -> Callable[[str], float]:
    """A type: a finite number >= lo (> lo when lo_open) and <= hi."""

    def parse(text: str) -> float:
        value = _float(text)
        if value < lo or (lo_open and value == lo) or (hi is not None and value > hi):
            low = f"more than {lo:g}" if lo_open else f"at least {lo:g}"
            bound = f"{low} and at most {hi:g}" if hi is not None else low
            raise argparse.ArgumentTypeError(f"{value:g} is out of range: must be {bound}")
        return value

    return parse


positive_int = int_in(1)
non_negative_int = int_in(0)
positive_float = float_in(0.0, lo_open=True)
non_negative_float = float_in(0.0)
fraction = float_in(0.0, 1.0)
port = int_in(1, 65535)
block_size = int_in(1, MAX_BLOCK_SIZE)
whole_number = _int
number = _float


def kv_cache_dtype(text: str) -> str:
    """auto | float32 | bfloat16 | float16 (bf16, fp16 and fp32 are accepted as aliases)."""
    try:
        return kv_cache_dtype_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def device(text: str) -> str:
    """auto | cpu | cuda | cuda:N (spelling only: whether CUDA is there is checked before the
    model loads, by radixserve.preflight)."""
    try:
        return device_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def json_value(text: str) -> Any:
    """A JSON document given on the command line."""
    try:
        return json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON: {e}") from None


# -------------------------------------------------------------------------- declarations


@dataclass(frozen=True)
class Option:
    """One option: a config field with its flag, help, value type and the commands taking it.

    `flag` None: a field for programs only (e.g. `EngineConfig.num_blocks`), with no flag.
    A bool field is a switch: `--flag` sets it True (default False), or a `--no-...` flag
    sets it False (default True). `repeat`: the flag may be given several times (a list).
    `nargs`: the flag takes that many values (a list). `default_text` says what a None
    default means ("the model's"); `command_defaults` overrides the default per command.
    """

    name: str
    default: Any
    help: str
    type: Callable[[str], Any] | None = None
    choices: tuple[Any, ...] | None = None
    flag: str | None = None
    short: str | None = None
    commands: frozenset[str] = frozenset()
    command_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    default_text: str | None = None
    env: str | None = None
    repeat: bool = False
    nargs: int | None = None
    metavar: str | tuple[str, ...] | None = None
    group: str | None = None

    @property
    def is_switch(self) -> bool:
        """A flag without a value (a bool field)."""
        return isinstance(self.default, bool)

    def default_for(self, command: str | None) -> Any:
        """The default under `command` (its override, else the declared one)."""
        if command is not None and command in self.command_defaults:
            return self.command_defaults[command]
        return self.default

    def describe_default(self, command: str | None = None) -> str | None:
        """The default as the help and the docs show it (None for a switch)."""
        if self.is_switch:
            return None
        default = self.default_for(command)
        if self.default_text is not None and (default is None or default == []):
            return self.default_text
        if default is None or default == []:
            return None
        if isinstance(default, (list, tuple)):
            return " ".join(str(d) for d in default)
        if isinstance(default, dict):
            return json.dumps(default)
        return f"{default:g}" if isinstance(default, float) else str(default)


def option(
    default: Any,
    help: str,
    *,
    type: Callable[[str], Any] | None = None,
    choices: Iterable[Any] | None = None,
    flag: str | None = "",
    short: str | None = None,
    commands: Iterable[str] = (),
    command_defaults: Mapping[str, Any] | None = None,
    default_text: str | None = None,
    env: str | None = None,
    repeat: bool = False,
    nargs: int | None = None,
    metavar: str | tuple[str, ...] | None = None,
    group: str | None = None,
) -> Any:
    """Declare a config dataclass field as an option (see `Option`); returns the field.

    `flag` "" (the default) derives `--field-name`; None declares no flag. `commands` empty:
    the option goes to every command its class is added to.
    """
    meta = {
        "default": default,
        "help": help,
        "type": type,
        "choices": tuple(choices) if choices is not None else None,
        "flag": flag,
        "short": short,
        "commands": frozenset(commands),
        "command_defaults": dict(command_defaults or {}),
        "default_text": default_text,
        "env": env,
        "repeat": repeat,
        "nargs": nargs,
        "metavar": metavar,
        "group": group,
    }
    if isinstance(default, (list, dict)):
        factory = lambda d=default: type_copy(d)  # noqa: E731
        return dataclasses.field(default_factory=factory, metadata={_META: meta})
    return dataclasses.field(default=default, metadata={_META: meta})


def type_copy(value: T) -> T:
    """A fresh copy of a list or dict default (each config gets its own)."""
    return json.loads(json.dumps(value))  # type: ignore[no-any-return]


def options_of(cls: type) -> list[Option]:
    """The options declared on dataclass `cls` (and its bases), in declaration order."""
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(_META)
        if meta is None:
            continue
        flag = meta["flag"]
        if flag == "":
            flag = "--" + f.name.replace("_", "-")
        out.append(Option(name=f.name, **{**meta, "flag": flag}))
    return out


def default_of(cls: type, name: str) -> Any:
    """The declared default of option `name` of `cls` (to share it with another option)."""
    for opt in options_of(cls):
        if opt.name == name:
            return opt.default
    raise KeyError(f"{cls.__name__} declares no option {name!r}")


def _takes(opt: Option, command: str | None) -> bool:
    return opt.flag is not None and (command is None or not opt.commands or command in opt.commands)


def help_text(opt: Option, command: str | None = None) -> str:
    """The option's help with its default appended, as `--help` and the docs show it."""
    shown = opt.describe_default(command)
    if opt.env:
        shown = f"${opt.env}" if shown is None else f"{shown}, or ${opt.env}"
    return f"{opt.help} (default: {shown})" if shown is not None else opt.help


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
        if opt.name in skipped or not _takes(opt, command):
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
            if opt.flag is not None and not _takes(opt, command):
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
