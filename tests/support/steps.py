"""Running a ModelRunner step in tests without spelling out every StepRow."""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.model.batch import SeqChunk
from radixserve.model.runner import ModelRunner, StepRow
from radixserve.model.sampling import SamplingRow


def run_step(
    runner: ModelRunner,
    spans: Sequence[SeqChunk],
    keep_logits: bool = False,
    sampling: Sequence[SamplingRow | None] | None = None,
) -> list[StepRow]:
    """One step over one row per span (greedy unless `sampling` says otherwise), its rows
    filled in."""
    how = sampling if sampling is not None else [None] * len(spans)
    rows = [StepRow(s, h, keep_logits) for s, h in zip(spans, how, strict=True)]
    runner.run(rows)
    return rows
