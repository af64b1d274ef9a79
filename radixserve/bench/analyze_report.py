"""The plain-text report of `radixserve analyze`, for any trace format."""

from __future__ import annotations

from radixserve.bench.analyze import Analysis, human_bytes


def format_analysis(a: Analysis) -> str:
    """The human-readable report printed by `radixserve analyze`."""
    p = a.shared_percentiles()
    with_hit = sum(1 for x in a.shared_lengths if x >= a.block_size)
    if a.exact:
        shares = [
            f"repeated-prefix tokens:   {a.shared_tokens} ({a.redundant_fraction:.1%}, exact)",
            f"  block-aligned ({a.block_size:>3}):    {a.shared_tokens_block} "
            f"({a.redundant_fraction_block:.1%})",
        ]
    else:
        shares = [
            f"reusable prefill:         {a.shared_tokens_block} ({a.redundant_fraction_block:.1%}"
            f", {a.trace_format} hash ids of {a.block_size}-token blocks, unbounded cache)",
        ]
    lines = [
        f"requests:                 {a.num_requests}",
        f"prompt tokens:            {a.prompt_tokens}",
        *shares,
        f"requests with a hit:      {with_hit} of {a.num_requests} (>= 1 block shared)",
        f"shared prefix per request: p50 {p['p50']:.0f}, p90 {p['p90']:.0f}, "
        f"p99 {p['p99']:.0f}, max {p['max']:.0f} tokens",
        f"KV per token:             {human_bytes(a.kv_bytes_per_token)} ({a.kv_dtype}); "
        f"unbounded cache holds {a.working_set_blocks} blocks = "
        f"{human_bytes(a.working_set_blocks * a.bytes_per_block)}",
    ]
    if a.breakdown:
        lines += ["", "                          requests  prompt tokens  reusable"]
        for label, row in a.breakdown.items():
            share = row["reusable"] / row["prompt_tokens"] if row["prompt_tokens"] else 0.0
            lines.append(
                f"  {label:<22}  {row['requests']:>8}  {row['prompt_tokens']:>13}  {share:>8.1%}"
            )
    lines += ["", "cache size (blocks)  memory      hit ratio  prefill saved (tokens)"]
    for c in a.curve:
        lines.append(
            f"{c.capacity_blocks:>19}  {human_bytes(c.capacity_bytes):>10}  "
            f"{c.hit_ratio:>9.1%}  {c.hit_tokens:>22}"
        )
    lines += ["", a.verdict()]
    if a.policy_curves:
        names = list(a.policy_curves)
        lines += [
            "",
            "hit ratio by eviction policy",
            "cache size (blocks)  " + "  ".join(f"{n:>8}" for n in names),
        ]
        for i, c in enumerate(a.policy_curves[names[0]]):
            cells = "  ".join(f"{a.policy_curves[n][i].hit_ratio:>8.1%}" for n in names)
            lines.append(f"{c.capacity_blocks:>19}  {cells}")
    return "\n".join(lines)
