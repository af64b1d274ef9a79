"""Options, each declared once, and everything derived from that declaration.

An option is a field of a config dataclass (`EngineConfig`, `ServerConfig`, `RouteConfig`, ...)
declared with `option(default, help, ...)` (declare.py). From the fields derive.py derives the
command line (`add_options`), the dataclass back from parsed flags (`from_args`), a worker's
argv (`to_argv`), plain dicts for Ray (`to_dict` / `from_dict`) and the docs' tables
(`markdown_table`). A declaration never repeats its default in its help: `add_options`
appends it. types.py holds the value types that parse one flag each. Nothing here imports
torch.
"""

from radixserve.options import types
from radixserve.options.declare import Option, default_of, help_text, option, options_of
from radixserve.options.derive import (
    add_options,
    from_args,
    from_dict,
    markdown_table,
    to_argv,
    to_dict,
)

__all__ = [
    "Option",
    "add_options",
    "default_of",
    "from_args",
    "from_dict",
    "help_text",
    "markdown_table",
    "option",
    "options_of",
    "to_argv",
    "to_dict",
    "types",
]
