"""Declaring an option: a config dataclass field made with `option(default, help, ...)`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
_META = "radixserve.option"


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


def applies_to(opt: Option, command: str | None) -> bool:
    """Whether `command` takes `opt` as a flag (None: any command)."""
    return opt.flag is not None and (command is None or not opt.commands or command in opt.commands)


def help_text(opt: Option, command: str | None = None) -> str:
    """The option's help with its default appended, as `--help` and the docs show it."""
    shown = opt.describe_default(command)
    if opt.env:
        shown = f"${opt.env}" if shown is None else f"{shown}, or ${opt.env}"
    return f"{opt.help} (default: {shown})" if shown is not None else opt.help
