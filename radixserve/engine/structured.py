"""Structured outputs: grammars compiled once per spec (llguidance), one matcher per request.

A `StructuredOutput` names what the output must match (a JSON schema, any JSON object, a
regex, one of some strings, or a Lark / GBNF grammar). `GrammarCompiler.compile` turns it
into a `CompiledGrammar`, cached by the spec's hash (agent loops send the same schema every
turn); it is meant to run off the engine thread (the server calls it in a worker thread
with a deadline; llguidance releases the GIL while it builds). Each request then gets a
`GrammarMatcher` (a cheap copy of the compiled one) whose `fill_bitmask` gives the allowed
tokens of its next step and whose `accept` advances it by the sampled token.

Why llguidance (measured on this repository's CPUs, docs/server.md has the figures): its
per-token cost is about 11 microseconds (xgrammar's 3; both well under 1% of a decode step),
it bounds compile work with explicit limits and refuses deep nesting with an error instead of
recursing, and it is one self-contained wheel; xgrammar spent minutes on a 1 MB schema that
llguidance compiles in seconds.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.errors import InvalidRequestError
from radixserve.model.sampling import unpack_bitmask

MAX_SPEC_BYTES = 256 * 1024  # a larger schema / grammar is refused before compiling
CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)
# JSON separators the constrained output uses: json.dumps' defaults. Fixed rather than free
# whitespace: small models otherwise wander into endless newlines inside an object.
JSON_STYLE: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Integers without bounds are generated within JSON's exactly representable range (as
# JavaScript's Number.MAX_SAFE_INTEGER): an unbounded digit run lets a small model repeat a
# digit until max_tokens and leave invalid JSON behind.
SAFE_INTEGER = 2**53 - 1


def bound_integers(schema: Any) -> Any:
    """A copy of JSON schema `schema` where every integer without a minimum or maximum gets
    +-SAFE_INTEGER."""
    if isinstance(schema, list):
        return [bound_integers(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bound_integers(v) for k, v in schema.items()}
    types = out.get("type")
    if types == "integer" or (isinstance(types, list) and "integer" in types):
        if not any(k in out for k in ("minimum", "exclusiveMinimum")):
            out["minimum"] = -SAFE_INTEGER
        if not any(k in out for k in ("maximum", "exclusiveMaximum")):
            out["maximum"] = SAFE_INTEGER
    return out


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match: `kind` (one of KINDS) and its text (a JSON
    schema serialized, a regex, a grammar; the choices joined by NUL; "" for json_object).
    `param` names the request field it came from, for error messages."""

    kind: str
    spec: str = ""
    param: str = "response_format"
    json_body: bool = False  # a grammar around JSON (tool calls): closed like JSON kinds

    @property
    def closes_as_json(self) -> bool:
        """Whether near max_tokens the output is steered to close (engine/closing.py)."""
        return self.kind in ("json", "json_object") or self.json_body

    @classmethod
    def json_schema(cls, schema: Any, param: str = "response_format") -> StructuredOutput:
        """A JSON schema (a dict, or its JSON text)."""
        text = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=False)
        return cls("json", text, param)

    @classmethod
    def choice(cls, options: Sequence[str], param: str = "guided_choice") -> StructuredOutput:
        """Exactly one of `options`."""
        return cls("choice", "\0".join(options), param)

    @property
    def key(self) -> str:
        """The cache key: a hash of the kind and the spec (not `param`)."""
        return hashlib.sha256(f"{self.kind}\0{self.spec}".encode()).hexdigest()

    def lark(self) -> str:
        """The spec as one llguidance grammar (Lark syntax, or its JSON grammar form)."""
        import llguidance
        from llguidance.gbnf_to_lark import any_to_lark

        if self.kind == "json":
            try:
                schema = json.loads(self.spec)
            except ValueError as e:
                raise InvalidRequestError(
                    f"{self.param}: the schema is not JSON: {e}", self.param
                ) from e
            if schema is True:
                schema = {}
            if not isinstance(schema, dict):
                raise InvalidRequestError(
                    f"{self.param}: a JSON schema must be an object", self.param
                )
            schema = bound_integers(schema)
            return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE))
        if self.kind == "json_object":
            return str(
                llguidance.LLMatcher.grammar_from_json_schema(
                    {"type": "object"}, defaults=JSON_STYLE
                )
            )
        if self.kind == "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(self.spec))
        if self.kind == "choice":
            options = self.spec.split("\0")
            return "start: " + " | ".join(json.dumps(o) for o in options)
        if self.kind == "grammar":
            return str(any_to_lark(self.spec))  # Lark as is; GBNF (`::=`) converted
        raise InvalidRequestError(f"unknown structured output kind {self.kind!r}", self.param)


class GrammarMatcher:
    """One request's place in its grammar. The engine thread alone calls it."""

    def __init__(self, matcher: Any, vocab_size: int, eos_ids: Sequence[int] = ()) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self._eos = list(eos_ids)

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the tokens allowed next into `row` (int32 [ceil(vocab / 32)], contiguous,
        host memory): bit j of word w allows token 32 w + j."""
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def accept(self, token_id: int) -> bool:
        """Advance by `token_id`; False (and the matcher broken) if the grammar forbids it."""
        return bool(self._m.consume_token(token_id))

    def accept_many(self, token_ids: Sequence[int]) -> int:
        """Advance by as many of `token_ids` as the grammar allows, in order; how many
        (for drafted tokens: verify several at once, then `rollback` the rejected)."""
        return int(self._m.try_consume_tokens(list(token_ids)))

    def count_valid(self, token_ids: Sequence[int]) -> int:
        """How many leading `token_ids` the grammar would accept, without advancing."""
        return int(self._m.validate_tokens(list(token_ids)))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        self._m.rollback(num_tokens)

    @property
    def is_finished(self) -> bool:
        """True once the grammar has ended: nothing, or only EOS, may follow."""
        if self._m.is_stopped():
            return True
        if not self._m.is_accepting():
            return False
        row = torch.zeros((self.vocab_size + 31) // 32, dtype=torch.int32)
        self.fill_bitmask(row)
        allowed = unpack_bitmask(row[None, :], self.vocab_size)[0]
        allowed[[e for e in self._eos if e < self.vocab_size]] = False
        return not bool(allowed.any())

    @property
    def error(self) -> str | None:
        """Why the matcher broke, if it did."""
        return str(self._m.get_error()) if self._m.is_error() else None


class CompiledGrammar:
    """A grammar built for one tokenizer; `matcher()` starts a request on it."""

    def __init__(self, template: Any, vocab_size: int, eos_ids: Sequence[int] = ()) -> None:
        self._template = template
        self.vocab_size = vocab_size
        self._eos = list(eos_ids)

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start (a copy: about a microsecond)."""
        return GrammarMatcher(self._template.deep_copy(), self.vocab_size, self._eos)


class GrammarCompiler:
    """Compiles structured-output specs for one tokenizer and caches them by hash.
    Thread-safe: any thread may compile; one spec is compiled once even when asked for by
    several threads at the same time."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_ids) or None  # the tokens a finished grammar allows
        self._ll_tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._pending: dict[str, threading.Event] = {}

    @property
    def bitmask_words(self) -> int:
        """int32 words per bitmask row."""
        return (self.vocab_size + 31) // 32

    def cached(self, spec: StructuredOutput) -> CompiledGrammar | None:
        """The compiled grammar of `spec` if it is in the cache (no compiling)."""
        with self._lock:
            found = self._cache.get(spec.key)
            if found is not None:
                self._cache.move_to_end(spec.key)
            return found

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar of `spec`, from the cache or built now (seconds for a large
        schema: call it off the engine thread). Raises InvalidRequestError naming the
        problem for a spec that is too large or does not compile."""
        key = spec.key
        while True:
            with self._lock:
                found = self._cache.get(key)
                if found is not None:
                    self._cache.move_to_end(key)
                    return found
                waiting = self._pending.get(key)
                if waiting is None:
                    self._pending[key] = threading.Event()
                    break
            waiting.wait()  # another thread compiles it; then look again
        try:
            compiled = self._build(spec)
        finally:
            with self._lock:
                self._pending.pop(key).set()
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _build(self, spec: StructuredOutput) -> CompiledGrammar:
        import llguidance

        if len(spec.spec.encode()) > MAX_SPEC_BYTES:
            raise InvalidRequestError(
                f"{spec.param}: the {spec.kind} spec is {len(spec.spec.encode())} bytes; "
                f"at most {MAX_SPEC_BYTES} are compiled",
                spec.param,
            )
        try:
            grammar = spec.lark()
            matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        except InvalidRequestError:
            raise
        except Exception as e:  # the converters raise what they like on odd input
            raise InvalidRequestError(f"{spec.param}: {_short(e)}", spec.param) from e
        if matcher.is_error():
            raise InvalidRequestError(
                f"{spec.param}: cannot compile this {spec.kind}: {_short(matcher.get_error())}",
                spec.param,
            )
        return CompiledGrammar(matcher, self.vocab_size, self._eos or ())

    def prepare(self) -> None:
        """Build llguidance's view of the tokenizer now, not in the first compile."""
        self._tokenizer()

    def _tokenizer(self) -> Any:
        """llguidance's view of the tokenizer, built on first use (about half a second for
        the default model's 49,152 tokens)."""
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self.vocab_size, eos_token=self._eos
                )
            return self._ll_tokenizer


def _short(e: object) -> str:
    """An error's text on one line, without the source excerpts and carets under it."""
    lines = [line.strip() for line in str(e).splitlines()]
    kept = [x for x in lines if x and not re.fullmatch(r"\^+|\d+ \|.*", x)]
    return (" ".join(kept) or type(e).__name__)[:400]
