"""What bounds speculative decoding on a workload: replay the drafters over its real outputs.

Greedy speculation never changes the output, so a workload's answers decoded once without it
say what any drafter would have been asked to guess. This script
1. decodes the first turns of a `radixserve bench` workload's sessions greedily (the default
   model, no speculation) and keeps each prompt's and answer's token ids;
2. measures, in process, what a decode step costs with one row and with K verified draft rows,
   at two context lengths, and fits step time = one-row time + rows x time per row, both
   linear in the context;
3. replays the engine's own drafting (radixserve.engine.speculative: prompt lookup, the
   cross-request suffix store, the adaptive draft length; the radix tree's continuation as the
   earlier requests' token lists, which the tree holds until evicted) over those answers,
   counting drafted and accepted tokens and the modelled decode time;
4. prints the modelled decode speed-up of speculation against none, the same if verified rows
   cost nothing, and for an oracle that drafts exactly what the model will accept (from any
   earlier occurrence of the last `--oracle-n` tokens), at today's row cost.

The modelled ratio is a model: `radixserve bench --compare` measures the real one. Tool calls
(the agent workload) are not replayed: their grammar decides what may be drafted.

    python benchmarks/spec_replay.py --workload rag_extract
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from radixserve.bench.corpus import TokenCounter
from radixserve.bench.workloads import build_sessions, make_workload
from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import LLMEngine
from radixserve.engine.llm import LLM
from radixserve.engine.params import SamplingParams
from radixserve.engine.spec_config import parse_speculative_config
from radixserve.engine.speculative import Speculator
from radixserve.model.batch import SeqChunk
from radixserve.model.runner import StepRow


@dataclass
class Answer:
    """One request: its prompt's and its greedy answer's token ids."""

    prompt: list[int]
    output: list[int]


def record(llm: LLM, workload: str, params: dict[str, str], seed: int) -> list[Answer]:
    """Each session's turns answered greedily, in order (later turns see earlier answers)."""
    sessions = build_sessions(make_workload(workload, params), seed, TokenCounter(llm.tokenizer))
    out = []
    for s in sessions:
        if s.tools:
            raise SystemExit(f"{workload} sends tools: its drafts depend on the grammar")
        while not s.done:
            msgs = s.messages()
            r = llm.chat(msgs, SamplingParams(max_tokens=s.max_tokens, temperature=0.0))[0]
            out.append(Answer(llm.tokenizer.apply_chat_template(msgs), list(r.token_ids)))
            s.record(r.text)
    return out


@dataclass
class StepCost:
    """Decode step time in ms: base(c) + rows x row(c) at c tokens of context."""

    base: tuple[float, float]  # intercept, slope per context token
    row: tuple[float, float]

    def step(self, context: int, rows: int, row_scale: float = 1.0) -> float:
        """A step over `context` tokens verifying `rows` drafted tokens."""
        one = self.base[0] + self.base[1] * context
        return one + rows * row_scale * (self.row[0] + self.row[1] * context)


def measure(engine: LLMEngine, contexts: tuple[int, int], k: int, repeats: int) -> StepCost:
    """Min-of-`repeats` times of a one-row step and a step verifying `k` drafts, at each
    context length, written into the pool's first blocks (before the engine starts)."""
    r = engine.runner
    points = []
    for ctx in contexts:
        table = list(range(ctx // r.block_size + 2))
        toks = [100 + (i * 7) % 3000 for i in range(ctx + k + 1)]
        r.run([StepRow(SeqChunk(toks[:ctx], 0, table))])
        chain = [SeqChunk([toks[ctx + j]], ctx + j, table) for j in range(k + 1)]
        drafts: list[int | None] = [toks[ctx + 1 + j] for j in range(k)]
        times: dict[int, list[float]] = {1: [], k + 1: []}
        for _ in range(repeats):
            for rows in times:
                t0 = time.perf_counter()
                marks = [*drafts[: rows - 1], None]
                r.run([StepRow(c, draft=d) for c, d in zip(chain[:rows], marks, strict=True)])
                times[rows].append((time.perf_counter() - t0) * 1e3)
        one, many = min(times[1]), min(times[k + 1])
        points.append((ctx, one, (many - one) / k))
    (c0, b0, w0), (c1, b1, w1) = points
    slope_b, slope_w = (b1 - b0) / (c1 - c0), (w1 - w0) / (c1 - c0)
    return StepCost((b0 - slope_b * c0, slope_b), (w0 - slope_w * c0, slope_w))


@dataclass
class _Req:
    """What Speculator.propose and record read of a request."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    namespace: Hashable = None
    error: str | None = None


class _EarlierRequests:
    """The radix tree's continuation as the earlier requests' full token lists."""

    enabled = True

    def __init__(self) -> None:
        self.seqs: list[list[int]] = []

    def continuation(self, tokens: Sequence[int], namespace: Hashable, k: int) -> list[int]:
        n, head = len(tokens), list(tokens)
        for s in reversed(self.seqs):
            if len(s) > n and s[:n] == head:
                return s[n : n + k]
        return []


@dataclass
class Replay:
    """Totals of one replay: modelled decode ms without and with speculation."""

    plain_ms: float = 0.0
    spec_ms: float = 0.0
    drafted: int = 0
    accepted: int = 0

    @property
    def ratio(self) -> float:
        return self.plain_ms / self.spec_ms


def plain_ms(a: Answer, cost: StepCost) -> float:
    """Modelled time of `a`'s decode steps without speculation (the first token is prefill's)."""
    return sum(cost.step(len(a.prompt) + j, 0) for j in range(1, len(a.output)))


def replay(answers: list[Answer], spec_json: str, cost: StepCost, row_scale: float) -> Replay:
    """The engine's drafters and draft-length policy over `answers`, one request at a time."""
    config = parse_speculative_config(spec_json)
    tree = _EarlierRequests()
    spec = Speculator(config, tree, 1 << 20)  # type: ignore[arg-type]
    out = Replay()
    for i, a in enumerate(answers):
        req = _Req(f"r{i}", list(a.prompt) + a.output[:1], len(a.prompt))
        n, done = len(a.output), 1
        out.plain_ms += plain_ms(a, cost)
        while done < n:
            drafts = spec.propose(req, n - done - 1)  # type: ignore[arg-type]
            ok = 0
            while ok < len(drafts) and drafts[ok] == a.output[done + ok]:
                ok += 1
            out.spec_ms += cost.step(len(req.token_ids), len(drafts), row_scale)
            if drafts:
                spec.record(req, len(drafts), ok)  # type: ignore[arg-type]
                out.drafted, out.accepted = out.drafted + len(drafts), out.accepted + ok
            req.token_ids += a.output[done : done + ok + 1]
            done += ok + 1
        spec.finish(req)  # type: ignore[arg-type]
        tree.seqs.append(req.token_ids)
    return out


def oracle(answers: list[Answer], k: int, n_match: int, cost: StepCost) -> Replay:
    """Drafts exactly the longest run (up to k) the model accepts that followed any earlier
    occurrence of the last `n_match` tokens, in the request or an earlier one."""
    out, earlier = Replay(), []
    for a in answers:
        toks, n, done = list(a.prompt) + a.output[:1], len(a.output), 1
        out.plain_ms += plain_ms(a, cost)
        while done < n:
            best, tail = 0, toks[-n_match:]
            for seq in [*earlier, toks]:
                for p in range(len(seq) - n_match):
                    if seq[p : p + n_match] == tail:
                        run = 0
                        while (
                            run < k
                            and done + run + 1 < n  # as the engine: room for its own token
                            and p + n_match + run < len(seq)
                            and seq[p + n_match + run] == a.output[done + run]
                        ):
                            run += 1
                        best = max(best, run)
            out.spec_ms += cost.step(len(toks), best)
            out.drafted += best
            out.accepted += best
            toks += a.output[done : done + best + 1]
            done += best + 1
        earlier.append(toks)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", default="rag_extract")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument(
        "--config",
        action="append",
        default=None,
        help='a --speculative-config to replay (repeatable; default K=5 and K=8, "radix")',
    )
    p.add_argument("--contexts", default="512,1536", help="two context lengths to time steps at")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--oracle-n", type=int, default=2)
    args = p.parse_args()
    configs = args.config or [
        '{"method": "radix", "num_speculative_tokens": 5}',
        '{"method": "radix", "num_speculative_tokens": 8}',
    ]
    params = dict(kv.split("=", 1) for kv in args.param)
    c0, c1 = (int(c) for c in args.contexts.split(","))
    engine = LLMEngine(EngineConfig(model=args.model, kv_cache_memory="1GiB"))
    cost = measure(engine, (c0, c1), 5, args.repeats)
    with LLM.from_engine(engine) as llm:
        answers = record(llm, args.workload, params, args.seed)
    contexts = [len(a.prompt) for a in answers]
    print(
        f"{args.workload}: {len(answers)} requests, {sum(len(a.output) for a in answers)} "
        f"output tokens, prompts of {statistics.median(contexts):.0f} tokens (median)"
    )
    for c in (c0, c1):
        print(
            f"step at {c} tokens of context: {cost.step(c, 0):.2f} ms, "
            f"+{cost.step(c, 1) - cost.step(c, 0):.2f} ms a verified draft row"
        )
    for spec_json in configs:
        for scale, label in ((1.0, "measured rows"), (0.0, "rows free")):
            r = replay(answers, spec_json, cost, scale)
            print(
                f"{spec_json} ({label}): decode {r.ratio:.2f}x, drafted {r.drafted}, "
                f"accepted {r.accepted} ({r.accepted / max(r.drafted, 1):.0%})"
            )
    for k in (5, 8):
        r = oracle(answers, k, args.oracle_n, cost)
        print(
            f"oracle, K={k}, from the last {args.oracle_n} tokens (measured rows): decode "
            f"{r.ratio:.2f}x, accepted {r.accepted}"
        )


if __name__ == "__main__":
    main()
