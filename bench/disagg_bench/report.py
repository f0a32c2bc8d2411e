"""The per-rate summary (vLLM's layout) and the PNG plot."""

from __future__ import annotations

import math


def summary(result: dict) -> str:
    rate = result["request_rate"]
    lines = ["{s:{c}^60}".format(s=f" disagg-bench: request rate {rate} ", c="=")]

    def row(label, value, fmt="{:.2f}"):
        lines.append(f"{label:<44}{fmt.format(value) if value is not None else '-':>16}")

    row("Request rate (req/s):", rate if not math.isinf(rate) else "inf", "{}")
    row("Burstiness:", result["burstiness"], "{}")
    row("Max concurrency:", result["max_concurrency"] or "-", "{}")
    row("Successful requests:", result["completed"], "{}")
    row("Failed requests:", result["failed"], "{}")
    for code, n in sorted(result["errors_by_code"].items()):
        row(f"  failed with {code}:", n, "{}")
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"], "{}")
    row("Total generated tokens:", result["total_output_tokens"], "{}")
    row("Request throughput (req/s):", result["request_throughput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Prefix cache hit rate (% of prompt tokens):", 100 * result.get("prefix_hit_rate", 0.0))
    if result.get("median_ttft_later_turns_ms") is not None:
        row("Median TTFT of turns 2+ (ms):", result["median_ttft_later_turns_ms"])
    if result["slo_attainment"] is not None:
        row("Request goodput (req/s):", result["request_goodput"])
        row("SLO attainment (%):", 100 * result["slo_attainment"])
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append("{s:{c}^60}".format(s=title, c="-"))
        row(f"Mean {name.upper()} (ms):", result[f"mean_{name}_ms"])
        for p in (50, 90, 99):
            row(f"P{p} {name.upper()} (ms):", result[f"p{p}_{name}_ms"])
    lines.append("=" * 60)
    return "\n".join(lines)


def plot(results: list, path: str) -> None:
    """Latency percentiles (TTFT, TPOT) and SLO attainment against the request rate (the
    offered rate; the measured one for an unlimited rate)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["request_rate"] if not math.isinf(r["request_rate"]) else r["request_throughput"] for r in results]
    order = sorted(range(len(results)), key=lambda i: xs[i])
    xs = [xs[i] for i in order]
    rs = [results[i] for i in order]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, name in zip(axes[:2], ("ttft", "tpot")):
        for p, style in ((50, "o-"), (90, "s-"), (99, "^-")):
            ax.plot(xs, [r[f"p{p}_{name}_ms"] for r in rs], style, label=f"p{p}")
        slo = rs[0].get(f"slo_{name}_ms")
        if slo is not None:
            ax.axhline(slo, color="red", linestyle="--", label="SLO")
        ax.set_title(f"{name.upper()} (ms)")
        ax.set_xlabel("request rate (req/s)")
        ax.legend()
        ax.grid(True, alpha=0.3)
    ax = axes[2]
    if rs[0]["slo_attainment"] is not None:
        ax.plot(xs, [100 * r["slo_attainment"] for r in rs], "o-", label="SLO attainment")
        ax.axhline(90, color="red", linestyle="--", label="90%")
        ax.set_ylim(0, 105)
        ax.set_title("SLO attainment (%)")
    else:
        ax.plot(xs, [r["request_throughput"] for r in rs], "o-", label="completed req/s")
        ax.set_title("request throughput (no SLO given)")
    ax.set_xlabel("request rate (req/s)")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
