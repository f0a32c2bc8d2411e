"""`scripts/bench compare`: the plan of the workload and the side-by-side summary of
disaggregated against colocated serving.

Goodput at 90% attainment (DistServe's definition): the highest request rate at
which at least 90% of the requests meet every SLO (TTFT and TPOT; a failed
request meets none). goodput_at_attainment() reads it off a rate sweep:

- the swept value: the highest swept rate r such that every swept rate <= r
  reaches 90% (a rate that reaches 90% above one that missed it does not count:
  it is noise, not capacity); 0 when the lowest rate misses
- the interpolated value (the one reported): the attainment curve is taken as
  linear between neighbouring swept rates, and the goodput is where it falls
  through 90% between the swept value and the next rate; the swept value when
  no rate misses (then `capped`: the true goodput may be higher), 0 when the
  lowest rate misses

The pure functions (model_shape aside, which reads 28 bytes) have no clock and
no I/O; tests/bench/test_metrics.py checks them against values worked out by hand.
The command line (python3 -m disagg_bench.compare, with bench/ on the path) is
what scripts/bench calls: `shape MODEL`, `plan ...`, `args PLAN MIX`, `summarize ...`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys

ATTAINMENT = 0.9
MIXES = ("prefill-heavy", "decode-heavy")
SYSTEMS = ("disagg", "colocated")
# Swept rates as multiples of the capacity probe's throughput (an all-at-once burst
# of 16 requests on the disaggregated cluster): below it, at it, and past it (a
# burst of 16 underestimates what batching more requests reaches).
RATE_MULTIPLIERS = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0)
# The unloaded probe: regular arrivals (gamma shape 100) at this fraction of the
# capacity probe's throughput, so that requests seldom overlap. (Requests sent
# back to back on one connection, --max-concurrency 1, measured ~40 ms more TTFT
# than spaced ones with stories260K: not unloaded latency.)
UNLOADED_FRACTION = 0.2
# Default SLOs: a multiple (DistServe's "SLO scale") of the unloaded TTFT / TPOT
# (p50 on the disaggregated cluster), with floors below which the 2-core
# machine's scheduling noise alone misses them.
SLO_SCALE = {"prefill-heavy": (4.0, 4.0), "decode-heavy": (4.0, 4.0)}  # (TTFT, TPOT)
SLO_FLOOR_MS = (25.0, 5.0)  # (TTFT, TPOT)


def model_shape(path: str) -> dict:
    """vocab_size and seq_len from a llama2.c checkpoint header (7 int32: dim, hidden_dim,
    n_layers, n_heads, n_kv_heads, vocab_size (negative: unshared classifier), seq_len)."""
    with open(path, "rb") as f:
        header = f.read(28)
    if len(header) < 28:
        raise ValueError(f"{path}: not a llama2.c checkpoint (shorter than its header)")
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = struct.unpack("<7i", header)
    return {"dim": dim, "hidden_dim": hidden, "n_layers": layers, "n_heads": heads, "n_kv_heads": kv_heads,
            "vocab_size": abs(vocab), "seq_len": seq_len}


def mix_lengths(seq_len: int, range_ratio: float = 0.25) -> dict:
    """Prompt and output lengths of the two mixes for a model with this context, so that the
    longest prompt plus the longest output (lengths vary by +-range_ratio) fit in seq_len.
    prefill-heavy: long prompts (3/4 of the context, at most 512 tokens), 16 new tokens;
    decode-heavy: 32-token prompts, 128 new tokens (fewer if the context is short)."""
    def fit(n):  # the mean length whose longest draw is at most n
        return max(1, int(n / (1 + range_ratio)))
    p_out = 16
    p_in = min(512, fit(seq_len * 3 // 4), fit(seq_len) - p_out - 1)
    d_in = min(32, fit(seq_len // 4))
    d_out = min(128, fit(seq_len - int(d_in * (1 + range_ratio)) - 1))
    return {"prefill-heavy": {"input_len": max(1, p_in), "output_len": p_out, "range_ratio": range_ratio},
            "decode-heavy": {"input_len": d_in, "output_len": max(1, d_out), "range_ratio": range_ratio}}


def _sig2(x: float) -> float:
    """x rounded to two significant digits (rates that read well)."""
    if x <= 0:
        return 0.0
    return round(x, 1 - int(math.floor(math.log10(x))))


def plan_mix(mix: str, unloaded: dict, burst: dict, sweep_s: float, min_prompts: int = 10,
             max_prompts: int = 400, slo_ttft_ms=None, slo_tpot_ms=None) -> dict:
    """One mix's sweep from the probes on the disaggregated cluster: unloaded (requests one at
    a time: median_ttft_ms, median_tpot_ms) and burst (all at once: request_throughput).
    Rates = RATE_MULTIPLIERS x the burst's throughput; prompts per rate so that the sweep takes
    about sweep_s at the offered rates (a rate above the capacity takes num_prompts/capacity);
    SLOs given win over the defaults (scale x unloaded, at least the floor)."""
    capacity = burst["request_throughput"]
    if not capacity > 0:
        raise ValueError(f"{mix}: the capacity probe completed no request")
    rates = sorted({_sig2(m * capacity) for m in RATE_MULTIPLIERS})
    units = sum(1.0 / m if m <= 1 else 1.0 for m in RATE_MULTIPLIERS)
    prompts = int(max(min_prompts, min(max_prompts, round(sweep_s * capacity / units))))
    scale_ttft, scale_tpot = SLO_SCALE[mix]
    ttft = slo_ttft_ms if slo_ttft_ms is not None else \
        _sig2(max(SLO_FLOOR_MS[0], scale_ttft * unloaded["median_ttft_ms"]))
    tpot = slo_tpot_ms if slo_tpot_ms is not None else \
        _sig2(max(SLO_FLOOR_MS[1], scale_tpot * unloaded["median_tpot_ms"]))
    return {"capacity_probe_req_s": capacity, "unloaded_ttft_ms": unloaded["median_ttft_ms"],
            "unloaded_tpot_ms": unloaded["median_tpot_ms"], "rates": rates, "num_prompts": prompts,
            "slo_ttft_ms": ttft, "slo_tpot_ms": tpot,
            "slo_source": {"ttft": "env" if slo_ttft_ms is not None else f"{scale_ttft:g} x unloaded",
                           "tpot": "env" if slo_tpot_ms is not None else f"{scale_tpot:g} x unloaded"}}


def goodput_at_attainment(results, threshold: float = ATTAINMENT) -> dict:
    """Goodput at `threshold` SLO attainment from one rate sweep (a list of disagg-bench
    results: request_rate, slo_attainment). See the module's docstring for the rule.
    Returns swept (req/s), interpolated (req/s), capped (no swept rate missed)."""
    points = sorted((r["request_rate"], r["slo_attainment"]) for r in results
                    if r.get("request_rate") is not None and not math.isinf(r["request_rate"]))
    if not points:
        raise ValueError("no finite swept rate")
    if any(a is None for _, a in points):
        raise ValueError("a result without SLO attainment: run disagg-bench with --slo-ttft-ms/--slo-tpot-ms")
    swept, below = 0.0, None
    for i, (rate, att) in enumerate(points):
        if att >= threshold:
            swept = rate
        else:
            below = i
            break
    if below is None:
        return {"swept": swept, "interpolated": swept, "capped": True}
    if below == 0:
        return {"swept": 0.0, "interpolated": 0.0, "capped": False}
    (r0, a0), (r1, a1) = points[below - 1], points[below]
    interpolated = r0 + (r1 - r0) * (a0 - threshold) / (a0 - a1)
    return {"swept": swept, "interpolated": interpolated, "capped": False}


def at_lowest_rate(results, field: str) -> float:
    finite = [r for r in results if not math.isinf(r["request_rate"])]
    return min(finite, key=lambda r: r["request_rate"])[field]


def ratio(x: float, y: float):
    """x / y; "inf" when only y is 0, "n/a" when both are."""
    if y == 0:
        return "n/a" if x == 0 else "inf"
    return x / y


def fmt_ratio(value) -> str:
    return value if isinstance(value, str) else f"{value:.2f}"


def summarize(sweeps: dict, threshold: float = ATTAINMENT) -> dict:
    """sweeps[mix][system] = that sweep's results list. Per mix and system: goodput (swept,
    interpolated), TTFT p90 and TPOT p90 at each rate and at the highest rate within the
    goodput, mean TTFT at the lowest rate; ratios disagg / colocated. The headline goodput is
    the sum over the mixes of the interpolated goodput."""
    out = {"attainment": threshold, "mixes": {}}
    total = {s: 0.0 for s in SYSTEMS}
    for mix, by_system in sweeps.items():
        entry = {}
        for system in SYSTEMS:
            results = by_system[system]
            g = goodput_at_attainment(results, threshold)
            total[system] += g["interpolated"]
            lowest = min(r["request_rate"] for r in results)
            entry[system] = {
                "goodput": g["interpolated"], "goodput_swept": g["swept"], "goodput_capped": g["capped"],
                "slo_ttft_ms": results[0].get("slo_ttft_ms"), "slo_tpot_ms": results[0].get("slo_tpot_ms"),
                "lowest_rate": lowest,
                "mean_ttft_ms_lowest_rate": at_lowest_rate(results, "mean_ttft_ms"),
                "p90_ttft_ms_lowest_rate": at_lowest_rate(results, "p90_ttft_ms"),
                "p90_tpot_ms_lowest_rate": at_lowest_rate(results, "p90_tpot_ms"),
                "per_rate": [{k: r.get(k) for k in ("request_rate", "slo_attainment", "completed", "failed",
                                                     "request_throughput", "p90_ttft_ms", "p90_tpot_ms",
                                                     "mean_ttft_ms", "total_output_tokens")}
                             for r in sorted(results, key=lambda r: r["request_rate"])],
            }
        d, c = entry["disagg"], entry["colocated"]
        entry["ratio"] = {"goodput": ratio(d["goodput"], c["goodput"]),
                          "mean_ttft_ms_lowest_rate": ratio(d["mean_ttft_ms_lowest_rate"],
                                                            c["mean_ttft_ms_lowest_rate"]),
                          "p90_ttft_ms_lowest_rate": ratio(d["p90_ttft_ms_lowest_rate"],
                                                           c["p90_ttft_ms_lowest_rate"]),
                          "p90_tpot_ms_lowest_rate": ratio(d["p90_tpot_ms_lowest_rate"],
                                                           c["p90_tpot_ms_lowest_rate"])}
        out["mixes"][mix] = entry
    out["goodput"] = {"disagg": total["disagg"], "colocated": total["colocated"],
                      "ratio": ratio(total["disagg"], total["colocated"])}
    return out


def final_line(summary: dict) -> str:
    g = summary["goodput"]
    r = g["ratio"] if isinstance(g["ratio"], str) else f"{g['ratio']:.3g}"
    return f"goodput disagg={g['disagg']:.3g} colocated={g['colocated']:.3g} ratio={r}"


def table(summary: dict) -> str:
    lines = [f"Goodput at {100 * summary['attainment']:.0f}% SLO attainment (DistServe): the highest request rate "
             f"at which at least {100 * summary['attainment']:.0f}% of requests meet every SLO; interpolated "
             "linearly between swept rates (swept: the highest swept rate reaching it; '>=': no swept rate "
             "missed it). Latencies at the lowest swept rate."]
    for mix, e in summary["mixes"].items():
        d, c, q = e["disagg"], e["colocated"], e["ratio"]
        lines.append("")
        lines.append(f"{mix}: SLO TTFT <= {d['slo_ttft_ms']:g} ms, TPOT <= {d['slo_tpot_ms']:g} ms; "
                     f"lowest rate {d['lowest_rate']:g} req/s")
        lines.append(f"  {'':<30}{'disagg':>12}{'colocated':>12}{'ratio':>8}")

        def row(label, key, fmt, ratio_key=None):
            dv, cv = d[key], c[key]
            rq = fmt_ratio(q[ratio_key]) if ratio_key else ""
            lines.append(f"  {label:<30}{fmt(dv, d):>12}{fmt(cv, c):>12}{rq:>8}")

        def gp(v, s):
            return (">=" if s["goodput_capped"] else "") + f"{v:.3g}"
        row("goodput (req/s)", "goodput", gp, "goodput")
        row("goodput, swept (req/s)", "goodput_swept", lambda v, s: f"{v:.3g}")
        row("mean TTFT (ms)", "mean_ttft_ms_lowest_rate", lambda v, s: f"{v:.1f}", "mean_ttft_ms_lowest_rate")
        row("TTFT p90 (ms)", "p90_ttft_ms_lowest_rate", lambda v, s: f"{v:.1f}", "p90_ttft_ms_lowest_rate")
        row("TPOT p90 (ms)", "p90_tpot_ms_lowest_rate", lambda v, s: f"{v:.2f}", "p90_tpot_ms_lowest_rate")
        lines.append(f"  {'rate (req/s)':<14}{'attainment d / c':>22}{'TTFT p90 d / c':>22}{'TPOT p90 d / c':>20}")
        for pd, pc in zip(d["per_rate"], c["per_rate"]):
            lines.append(f"  {pd['request_rate']:<14g}{100 * pd['slo_attainment']:>10.1f}% / "
                         f"{100 * pc['slo_attainment']:>5.1f}%{pd['p90_ttft_ms']:>11.1f} / {pc['p90_ttft_ms']:<8.1f}"
                         f"{pd['p90_tpot_ms']:>9.2f} / {pc['p90_tpot_ms']:<8.2f}")
    g = summary["goodput"]
    lines.append("")
    lines.append(f"headline goodput = the sum over both mixes of the interpolated goodput: disagg "
                 f"{g['disagg']:.3g}, colocated {g['colocated']:.3g} req/s")
    return "\n".join(lines)


def plot(summary: dict, path: str) -> None:
    """SLO attainment against the request rate, disaggregated and colocated, one panel per
    mix, with the 90% line and each side's goodput."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixes = list(summary["mixes"].items())
    fig, axes = plt.subplots(1, len(mixes), figsize=(6.5 * len(mixes), 4.5), squeeze=False)
    for ax, (mix, e) in zip(axes[0], mixes):
        for system, style, color in (("disagg", "o-", "tab:blue"), ("colocated", "s--", "tab:orange")):
            pts = e[system]["per_rate"]
            ax.plot([p["request_rate"] for p in pts], [100 * p["slo_attainment"] for p in pts], style, color=color,
                    label=f"{system}: goodput {'>=' if e[system]['goodput_capped'] else ''}"
                          f"{e[system]['goodput']:.3g} req/s")
            ax.axvline(e[system]["goodput"], color=color, linestyle=":", alpha=0.7)
        ax.axhline(100 * summary["attainment"], color="red", linestyle="--", label="90%")
        d = e["disagg"]
        ax.set_title(f"{mix} (SLO TTFT {d['slo_ttft_ms']:g} ms, TPOT {d['slo_tpot_ms']:g} ms)")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("SLO attainment (%)")
        ax.set_ylim(0, 105)
        ax.legend()
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- the command line (scripts/bench compare) ----

def _load_results(path: str) -> list:
    with open(path) as f:
        results = json.load(f)["results"]
    for r in results:  # inf is written as null
        if r.get("request_rate") is None:
            r["request_rate"] = math.inf
    return results


def _env_float(name: str):
    value = os.environ.get(name, "")
    return float(value) if value else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="compare")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("shape", help="print 'VOCAB SEQ_LEN' of a llama2.c checkpoint")
    p.add_argument("model")
    p = sub.add_parser("lengths", help="print the mixes' lengths for a context: MIX INPUT OUTPUT RANGE")
    p.add_argument("seq_len", type=int)
    p = sub.add_parser("unloaded-rate", help="print the unloaded probe's rate from the burst probe's results")
    p.add_argument("burst")
    p = sub.add_parser("plan", help="write the plan JSON from the probes' result files")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--probe-dir", required=True, help="holds MIX-unloaded.json and MIX-burst.json")
    p.add_argument("--sweep-s", type=float, required=True)
    p.add_argument("--out", required=True)
    p = sub.add_parser("args", help="print a mix's disagg-bench arguments, one a line")
    p.add_argument("plan")
    p.add_argument("mix", choices=MIXES)
    p = sub.add_parser("summarize", help="print the table and the goodput line; write the summary JSON")
    p.add_argument("--dir", required=True, help="holds SYSTEM-MIX.json and plan.json")
    p.add_argument("--out", required=True)
    p.add_argument("--plot", help="write the attainment curves of both sides as a PNG here")
    a = ap.parse_args(argv)

    if a.cmd == "shape":
        s = model_shape(a.model)
        print(s["vocab_size"], s["seq_len"])
    elif a.cmd == "lengths":
        for mix, m in mix_lengths(a.seq_len).items():
            print(mix, m["input_len"], m["output_len"], m["range_ratio"])
    elif a.cmd == "unloaded-rate":
        print(f"{_sig2(UNLOADED_FRACTION * _load_results(a.burst)[0]['request_throughput']):g}")
    elif a.cmd == "plan":
        lengths = mix_lengths(a.seq_len)
        plan = {"vocab_size": a.vocab_size, "seq_len": a.seq_len, "rate_multipliers": list(RATE_MULTIPLIERS),
                "mixes": {}}
        for mix in MIXES:
            key = "PREFILL" if mix == "prefill-heavy" else "DECODE"
            unloaded = _load_results(os.path.join(a.probe_dir, f"{mix}-unloaded.json"))[0]
            burst = _load_results(os.path.join(a.probe_dir, f"{mix}-burst.json"))[0]
            entry = plan_mix(mix, unloaded, burst, a.sweep_s,
                             slo_ttft_ms=_env_float(f"{key}_SLO_TTFT_MS"),
                             slo_tpot_ms=_env_float(f"{key}_SLO_TPOT_MS"))
            rates = os.environ.get(f"{key}_RATES", "")
            if rates:
                entry["rates"] = sorted(float(r) for r in rates.split(","))
            prompts = os.environ.get(f"{key}_PROMPTS", "")
            if prompts:
                entry["num_prompts"] = int(prompts)
            entry.update(lengths[mix])
            plan["mixes"][mix] = entry
        with open(a.out, "w") as f:
            json.dump(plan, f, indent=1)
        for mix, e in plan["mixes"].items():
            print(f"compare: {mix}: prompts {e['input_len']} tokens, outputs {e['output_len']} "
                  f"(+-{100 * e['range_ratio']:.0f}%); SLO TTFT <= {e['slo_ttft_ms']:g} ms ({e['slo_source']['ttft']}),"
                  f" TPOT <= {e['slo_tpot_ms']:g} ms ({e['slo_source']['tpot']}); unloaded TTFT "
                  f"{e['unloaded_ttft_ms']:.1f} ms, TPOT {e['unloaded_tpot_ms']:.2f} ms; capacity probe "
                  f"{e['capacity_probe_req_s']:.3g} req/s; rates {','.join(f'{r:g}' for r in e['rates'])}; "
                  f"{e['num_prompts']} prompts per rate")
    elif a.cmd == "args":
        with open(a.plan) as f:
            plan = json.load(f)
        e = plan["mixes"][a.mix]
        args = ["--request-rates", ",".join(f"{r:g}" for r in e["rates"]), "--num-prompts", str(e["num_prompts"]),
                "--input-len", str(e["input_len"]), "--output-len", str(e["output_len"]),
                "--range-ratio", str(e["range_ratio"]), "--vocab-size", str(plan["vocab_size"]),
                "--slo-ttft-ms", f"{e['slo_ttft_ms']:g}", "--slo-tpot-ms", f"{e['slo_tpot_ms']:g}"]
        print("\n".join(args))
    elif a.cmd == "summarize":
        sweeps = {mix: {s: _load_results(os.path.join(a.dir, f"{s}-{mix}.json")) for s in SYSTEMS}
                  for mix in MIXES}
        summary = summarize(sweeps)
        with open(os.path.join(a.dir, "plan.json")) as f:
            summary["plan"] = json.load(f)
        with open(a.out, "w") as f:
            json.dump(summary, f, indent=1)
        print(table(summary))
        print(f"compare: summary in {a.out}")
        if a.plot:
            plot(summary, a.plot)
            print(f"compare: plot in {a.plot}")
        print(final_line(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
