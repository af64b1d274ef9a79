"""Every option is declared once: the CLI's flags, their --help, the LLM(...) keywords and
docs/options.md all come from the declarations (radixserve.options)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
from pathlib import Path

import pytest

from radixserve import cli
from radixserve.engine.config import EngineConfig
from radixserve.options import Option, help_text, options_of

ROOT = Path(__file__).resolve().parents[1]

# Each command and the declared classes whose options it takes.
COMMAND_CLASSES = {
    "serve": ["radixserve.server.config:WorkerOptions", "radixserve.launch:LaunchConfig"],
    "generate": ["radixserve.engine.config:EngineConfig", "radixserve.offline:GenerateConfig"],
    "chat": ["radixserve.engine.config:EngineConfig", "radixserve.offline:GenerateConfig"],
    "route": [
        "radixserve.router.main:RouteConfig",
        "radixserve.router.policy:PolicyConfig",
        "radixserve.router.worker:WorkerConfig",
    ],
    "bench": ["radixserve.bench.config:BenchConfig"],
    "analyze": ["radixserve.bench.config:AnalyzeConfig"],
}


def _declared(command: str) -> list[Option]:
    out = []
    for path in COMMAND_CLASSES[command]:
        module, name = path.split(":")
        cls = getattr(importlib.import_module(module), name)
        out += [o for o in options_of(cls) if o.flag and (not o.commands or command in o.commands)]
    return out


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found: argparse.ArgumentParser = sub.choices[command]
    return found


def _squash(text: str) -> str:
    # argparse wraps help lines, breaking at spaces and hyphens: compare without whitespace
    return re.sub(r"\s+", "", text)


def test_docs_options_page_is_generated_from_the_declarations() -> None:
    page = (ROOT / "docs" / "options.md").read_text()
    assert page == cli.options_markdown(), (
        "docs/options.md is stale: regenerate it with "
        "python -c 'import radixserve.cli as c; print(c.options_markdown(), end=\"\")' "
        "> docs/options.md"
    )


@pytest.mark.parametrize("command", sorted(COMMAND_CLASSES))
def test_every_flag_of_a_command_is_a_declared_option(command: str) -> None:
    declared = {o.flag for o in _declared(command)} | {o.short for o in _declared(command)}
    flags = {
        s
        for a in _subparser(command)._actions
        for s in a.option_strings
        if s not in ("-h", "--help")
    }
    assert flags == declared - {None}


@pytest.mark.parametrize("command", sorted(COMMAND_CLASSES))
def test_help_shows_each_declared_default_once_declared(command: str) -> None:
    shown = _squash(_subparser(command).format_help())
    for opt in _declared(command):
        assert "(default:" not in opt.help, f"{opt.flag}: the help repeats its default"
        assert _squash(help_text(opt, command)) in shown, opt.flag
        default = opt.describe_default(command)
        if default is not None:
            assert _squash(f"(default: {default}") in shown, opt.flag


def test_parsed_defaults_are_the_declared_defaults() -> None:
    args = _subparser("serve").parse_args([])
    for opt in _declared("serve"):
        if opt.env is None:
            assert getattr(args, opt.name) == opt.default, opt.name
    gen = _subparser("generate").parse_args(["hi"])
    assert gen.kv_cache_memory == "256MiB"  # generate's own default, declared beside the other


def test_an_unknown_engine_option_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match="kv_cache"):
        EngineConfig(kv_cache="1GiB")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="nope"):
        dataclasses.replace(EngineConfig(), nope=1)  # type: ignore[call-arg]
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineConfig().block_size = 8  # type: ignore[misc]


def test_llm_takes_exactly_the_engine_config_fields() -> None:
    from radixserve.engine.llm import LLM

    with pytest.raises(TypeError, match="kv_cache"):
        LLM(kv_cache="1GiB")  # fails before any model loads
