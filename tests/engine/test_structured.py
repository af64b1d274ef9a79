"""Structured outputs on the tiny model: grammar masks per row, exact beside free rows."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from radixserve.engine.params import SamplingParams
from radixserve.engine.structured import StructuredOutput
from radixserve.errors import InvalidRequestError
from tests.support import Collector, run_until_idle

PROMPT = list(range(300, 321))
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "ok": {"type": "boolean"},
    },
    "required": ["city", "unit", "ok"],
    "additionalProperties": False,
}
SPECS = {
    "json": StructuredOutput.json_schema(SCHEMA),
    "regex": StructuredOutput("regex", r"[a-z]{3}-\d{2}"),
    "choice": StructuredOutput.choice(["yes", "no", "maybe"]),
    "grammar": StructuredOutput("grammar", 'root ::= "A" ("b" | "c") ("b" | "c") "!"'),
}


def constrained(spec: StructuredOutput | None, **kw) -> SamplingParams:
    fields = {"max_tokens": 40, "temperature": 0.0, "logprobs": 2, **kw}
    return SamplingParams(structured=spec, **fields)


def check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(r"[a-z]{3}-\d{2}", text), text
    elif kind == "choice":
        assert text in ("yes", "no", "maybe")
    else:
        assert re.fullmatch(r"A[bc]{2}!", text), text


def test_constrained_and_free_rows_share_a_step_and_the_free_one_is_unchanged(
    make_tiny_engine,
) -> None:
    engine, col = make_tiny_engine(num_blocks=256), Collector()
    free = constrained(None, max_tokens=12, ignore_eos=True)
    alone = engine.add_request(PROMPT, free, on_output=col)
    run_until_idle(engine)
    rids = {k: engine.add_request(PROMPT, constrained(s), on_output=col) for k, s in SPECS.items()}
    beside = engine.add_request(PROMPT, free, on_output=col)
    engine.step()
    # All five ran in that one step: each has its first token (a choice that one token
    # completes has finished already, so count outputs, not running requests).
    assert not engine.scheduler.waiting
    assert all(col.outputs.get(rid) for rid in [*rids.values(), beside])
    run_until_idle(engine)
    for kind, rid in rids.items():
        out = col.final(rid)
        assert out.finish_reason == "stop", (kind, out.text)
        check(kind, out.text)
    assert col.final(beside).token_ids == col.final(alone).token_ids
    pairs = zip(col.final(beside).logprobs, col.final(alone).logprobs, strict=True)
    assert all(abs(a.logprob - b.logprob) <= 1e-5 for a, b in pairs)  # batch rounding only


def test_seeded_sampling_under_a_grammar_still_matches_it(make_tiny_engine) -> None:
    engine, col = make_tiny_engine(num_blocks=256), Collector()
    params = [constrained(SPECS["json"], temperature=1.0, seed=s) for s in range(4)]
    rids = [engine.add_request(PROMPT, p, on_output=col) for p in params]
    run_until_idle(engine)
    texts = [col.final(r).text for r in rids]
    for text in texts:
        check("json", text)
    assert len(set(texts)) > 1


def test_constrained_output_and_logprobs_are_equal_with_the_cache_on_and_off(
    make_tiny_engine,
) -> None:
    results = []
    for cache in (True, False):
        engine, col = make_tiny_engine(num_blocks=256, enable_prefix_cache=cache), Collector()
        first = engine.add_request(PROMPT, constrained(SPECS["json"]), on_output=col)
        run_until_idle(engine)
        again = engine.add_request(PROMPT, constrained(SPECS["json"]), on_output=col)
        run_until_idle(engine)
        assert col.final(again).num_cached_tokens == (20 if cache else 0)
        results += [col.final(first), col.final(again)]
    texts = {o.text for o in results}
    assert len(texts) == 1
    base = results[0].logprobs
    for other in results[1:]:
        for a, b in zip(base, other.logprobs, strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= 1e-5


def test_a_grammar_is_compiled_once_per_spec(make_tiny_engine) -> None:
    engine = make_tiny_engine()
    first = engine.grammars.compile(SPECS["regex"])
    assert engine.grammars.compile(StructuredOutput("regex", r"[a-z]{3}-\d{2}")) is first
    assert engine.grammars.cached(SPECS["choice"]) is None


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (StructuredOutput.json_schema({"type": "nonsense"}), "nonsense"),
        (StructuredOutput("regex", "(ab", "guided_regex"), "unclosed group"),
        (StructuredOutput("grammar", "start: missing_rule", "guided_grammar"), "missing_rule"),
        (StructuredOutput("json", "{not json"), "not JSON"),
    ],
)
def test_a_spec_that_does_not_compile_is_an_invalid_request_naming_the_problem(
    make_tiny_engine, spec: StructuredOutput, words: str
) -> None:
    with pytest.raises(InvalidRequestError, match=words) as info:
        make_tiny_engine().add_request(PROMPT, constrained(spec))
    assert info.value.param == spec.param


def test_hostile_specs_are_refused_quickly(make_tiny_engine) -> None:
    engine = make_tiny_engine()
    engine.grammars.compile(SPECS["choice"])  # the tokenizer conversion, once, not timed
    level = '{"type": "object", "properties": {"a": '
    deep = level * 3000 + '{"type": "string"}' + "}}" * 3000  # as text: too deep for json
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(30000)}}
    for schema, words in ((deep, "recursion"), (huge, "bytes")):
        started = time.monotonic()
        with pytest.raises(InvalidRequestError, match=words):
            engine.grammars.compile(StructuredOutput.json_schema(schema))
        assert time.monotonic() - started < 5.0
    # A catastrophic-backtracking regex is no problem for a derivative-based matcher.
    engine.grammars.compile(StructuredOutput("regex", r"(a+)+(b|c|d){1,200}x{100,1000}"))


def test_the_matcher_checks_and_rolls_back_several_tokens(make_tiny_engine) -> None:
    engine = make_tiny_engine()
    tok = engine.tokenizer
    matcher = engine.grammars.compile(SPECS["regex"]).matcher()
    good, bad = tok.encode("abc-12"), tok.encode("abc-x")
    assert matcher.count_valid(good) == len(good)
    assert matcher.count_valid(bad) < len(bad)
    assert matcher.accept_many(good) == len(good)
    matcher.rollback(len(good))
    valid = matcher.count_valid(bad)
    assert matcher.accept_many(bad) == valid  # stops at the first token the regex forbids


def test_a_json_output_near_max_tokens_is_steered_to_close_and_stays_valid(
    make_tiny_engine,
) -> None:
    schema = {
        "type": "object",
        "properties": {"note": {"type": "string"}, "tags": {"type": "array"}},
        "required": ["note", "tags"],
    }
    engine, col = make_tiny_engine(num_blocks=256), Collector()
    rids = [
        engine.add_request(
            PROMPT,
            constrained(
                StructuredOutput.json_schema(schema), temperature=1.0, seed=s, max_tokens=24
            ),
            on_output=col,
        )
        for s in range(4)
    ]
    run_until_idle(engine)
    for rid in rids:
        out = col.final(rid)
        assert out.finish_reason == "stop" and len(out.token_ids) <= 24
        jsonschema.validate(json.loads(out.text), schema)


def test_tables_built_before_start_are_the_ones_the_first_requests_use(make_tiny_engine) -> None:
    engine, col = make_tiny_engine(num_blocks=256), Collector()
    engine.prepare_structured_outputs()
    closer, ll_tokenizer = engine._closer, engine.grammars._ll_tokenizer
    assert closer is not None and ll_tokenizer is not None
    spec = StructuredOutput.json_schema(
        {"type": "object", "properties": {"note": {"type": "string"}}}
    )
    rid = engine.add_request(
        PROMPT, constrained(spec, temperature=1.0, seed=0, max_tokens=16), on_output=col
    )
    run_until_idle(engine)
    json.loads(col.final(rid).text)  # steered to close within max_tokens, by those tables
    assert engine._closer is closer and engine.grammars._ll_tokenizer is ll_tokenizer


def test_tables_built_in_the_background_serve_a_request_that_comes_meanwhile(
    make_tiny_engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server builds the tables on a thread of its own while it listens: a constrained
    request that arrives meanwhile waits for what it needs, and each table is built once."""
    import radixserve.engine.engine as engine_module

    engine, col = make_tiny_engine(num_blocks=256), Collector()
    builds: list[float] = []
    real = engine_module.JsonCloser

    def slow_closer(*args):
        builds.append(time.monotonic())
        time.sleep(0.5)  # still building while the request runs to its closing tokens
        return real(*args)

    monkeypatch.setattr(engine_module, "JsonCloser", slow_closer)
    engine.prepare_structured_outputs(background=True)
    spec = StructuredOutput.json_schema(
        {"type": "object", "properties": {"note": {"type": "string"}}}
    )
    rid = engine.add_request(
        PROMPT, constrained(spec, temperature=1.0, seed=0, max_tokens=16), on_output=col
    )
    run_until_idle(engine)
    json.loads(col.final(rid).text)  # steered to close within max_tokens by the one table
    assert len(builds) == 1 and engine._closer is not None
    assert engine.grammars._ll_tokenizer is not None


def test_shutdown_waits_for_a_background_build_of_the_tables(make_tiny_engine) -> None:
    """A server stopped right after it listens must not exit mid-build: the process aborted
    there ("terminate called without an active exception") when the build was in native
    code. shutdown() waits for it, and the thread is no daemon."""
    engine = make_tiny_engine()
    engine.prepare_structured_outputs(background=True)
    assert engine._tables is not None and not engine._tables.daemon
    engine.shutdown()
    assert not engine._tables.is_alive() and engine._closer is not None


def test_a_table_that_cannot_be_built_at_start_is_logged_and_left_to_the_requests(
    make_tiny_engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_tiny_engine()

    def broken() -> None:
        raise ValueError("no such vocabulary")

    monkeypatch.setattr(engine.grammars, "_tokenizer", broken)
    engine.prepare_structured_outputs()
    assert "no such vocabulary" in caplog.text
    assert engine._closer is not None  # the other table is still built
    with pytest.raises(InvalidRequestError, match="no such vocabulary"):
        engine.add_request(PROMPT, constrained(SPECS["regex"]))
