"""Real text for benchmark prompts: docstrings and source of the Python standard library.

Text is drawn without replacement from a seed-shuffled walk over the stdlib directory
(`sysconfig.get_paths()["stdlib"]`), so the same seed on the same Python install gives the
same prompts, and two passages never start with the same words (no accidental sharing).
"""

from __future__ import annotations

import ast
import inspect
import os
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

# Sub-directories that are mostly test data, generated tables or vendored code.
SKIP_DIRS = {
    "test",
    "tests",
    "idlelib",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "lib2to3",
    "turtledemo",
    "ensurepip",
    "encodings",
    "pydoc_data",
}
MIN_PARAGRAPH_CHARS = 60
# Passages are deduplicated on their opening characters so none can share a prefix block.
DEDUP_CHARS = 40
CHARS_PER_TOKEN = 4.0  # the estimate used when no tokenizer is available


class TextCodec(Protocol):
    """What the corpus needs from a tokenizer."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class TokenCounter:
    """Measures and truncates text in tokens: exactly with a tokenizer, else ~4 chars/token."""

    def __init__(self, codec: TextCodec | None = None) -> None:
        self.codec = codec

    @property
    def exact(self) -> bool:
        """Whether sizes are measured with a real tokenizer."""
        return self.codec is not None

    def count(self, text: str) -> int:
        """Number of tokens in `text` (estimated without a tokenizer)."""
        if self.codec is None:
            return round(len(text) / CHARS_PER_TOKEN)
        return len(self.codec.encode(text))

    def cut(self, text: str, num_tokens: int) -> str:
        """The first `num_tokens` tokens of `text` (whole text if shorter)."""
        if self.codec is None:
            return text[: int(num_tokens * CHARS_PER_TOKEN)]
        ids = self.codec.encode(text)
        if len(ids) <= num_tokens:
            return text
        return self.codec.decode(ids[:num_tokens]).rstrip("\ufffd")


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """All .py files under the stdlib directory (minus tests and data), in sorted order."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    out: list[Path] = []
    for d, dirs, files in os.walk(base):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith("config-"))
        out.extend(Path(d) / f for f in sorted(files) if f.endswith(".py"))
    return out


def docstrings(source: str) -> list[str]:
    """Module, class and function docstrings of a Python source text, cleaned."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    nodes = [tree] + [
        n
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    ]
    out = []
    for n in nodes:
        doc = ast.get_docstring(n, clean=False)
        if doc:
            out.append(inspect.cleandoc(doc))
    return out


def paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs of `text`, stripped, long enough to be prose."""
    paras = (p.strip() for p in text.split("\n\n"))
    return [p for p in paras if len(p) >= MIN_PARAGRAPH_CHARS]


class Corpus:
    """A seed-shuffled, never-repeating stream of stdlib paragraphs cut into token-sized passages.

    Docstrings of every file come first (prose); once they run out the source code itself
    is used. `passage` raises RuntimeError if even that is exhausted.
    """

    def __init__(
        self,
        seed: int | str,
        counter: TokenCounter | None = None,
        root: str | Path | None = None,
    ) -> None:
        self.counter = counter or TokenCounter()
        self.rng = random.Random(f"corpus:{seed}")
        files = stdlib_files(root)
        self.rng.shuffle(files)
        self._files = files
        self._stream = self._paragraphs()
        self._seen: set[str] = set()
        self._source_files = iter(files)

    def _paragraphs(self) -> Iterator[tuple[str, str]]:
        for source_pass in (False, True):
            for f in self._files:
                try:
                    text = f.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                chunks = [text] if source_pass else docstrings(text)
                for chunk in chunks:
                    for p in paragraphs(chunk):
                        yield f.stem, p

    def _next_paragraph(self) -> tuple[str, str]:
        for name, p in self._stream:
            key = " ".join(p.split())[:DEDUP_CHARS]
            if key not in self._seen:
                self._seen.add(key)
                return name, p
        raise RuntimeError("the stdlib corpus is exhausted; ask for fewer or shorter prompts")

    def passage(self, num_tokens: int) -> str:
        """Fresh text of about `num_tokens` tokens, starting at a paragraph never used before."""
        return self.named_passage(num_tokens)[1]

    def sentence(self, max_tokens: int = 40) -> str:
        """The first sentence of a fresh paragraph, at most `max_tokens` tokens."""
        _, p = self._next_paragraph()
        first = " ".join(p.split()).split(". ")[0].rstrip(".") + "."
        return self.counter.cut(first, max_tokens)

    def named_passage(self, num_tokens: int) -> tuple[str, str]:
        """Like `passage`, plus the module name the text came from (for agent tool outputs)."""
        name, p = self._next_paragraph()
        parts, have = [p], self.counter.count(p)
        while have < num_tokens + 8:  # a margin: counts of parts only approximate the whole
            _, more = self._next_paragraph()
            parts.append(more)
            have += self.counter.count(more) + 1
        return name, self.counter.cut("\n\n".join(parts), num_tokens)

    def source_passage(self, num_tokens: int) -> tuple[str, str]:
        """About `num_tokens` tokens of one module's source code, from its first top-level
        `def` or `class` on (past the licence header and imports), and the module name; each
        call takes a file no earlier call took. RuntimeError when no file is left."""
        for f in self._source_files:
            try:
                lines = f.read_text(encoding="utf-8").split("\n")
            except (OSError, UnicodeDecodeError):
                continue
            start = next(
                (i for i, line in enumerate(lines) if line.startswith(("def ", "class "))), None
            )
            if start is None:
                continue
            text = "\n".join(lines[start:])
            if self.counter.count(text) >= num_tokens:
                return f.stem, self.counter.cut(text, num_tokens)
        raise RuntimeError("the stdlib corpus has no more source files to draw from")
