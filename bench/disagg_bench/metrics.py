"""Serving metrics over recorded per-request timelines, with vLLM's definitions.

Pure: no clock, no I/O. compute_metrics() takes the records of one run and
returns a dict whose field names follow `vllm bench serve`'s JSON:

- TTFT  = first streamed chunk - send time
- E2EL  = last streamed chunk - send time (the request's latency)
- TPOT  = (E2EL - TTFT) / (output tokens - 1), for requests with > 1 output token
- ITL   = every gap between consecutive streamed chunks (all requests pooled)
- a request is good when it completed and meets every SLO given
  (TTFT <= slo_ttft_ms, TPOT <= slo_tpot_ms; a 1-token request's TPOT counts as 0)
- request_goodput = good requests / duration; slo_attainment = good / all requests
  (failed requests count as not good)
Percentiles interpolate linearly between ranks, as numpy.percentile does.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Optional

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request's timeline. Times in seconds on any monotonic clock."""
    send_time: float
    chunk_times: list = field(default_factory=list)  # arrival of each streamed chunk carrying choices
    prompt_tokens: int = 0
    output_tokens: int = 0  # usage.completion_tokens (the client falls back to the chunk count)
    error: Optional[str] = None  # None: completed; else its error code, e.g. "503 overloaded"
    end_time: Optional[float] = None  # when the request ended, completed or failed
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens: prompt tokens the prefix cache held
    text: str = ""  # the streamed text (a multi-turn conversation appends it to its history)
    turn: int = 0  # multi-turn: the request's turn in its conversation (1 = the first); 0 otherwise
    token_ids: list = field(default_factory=list)  # the streamed token ids (return_token_ids)


def percentile(values, p: float) -> float:
    """numpy.percentile(values, p) with the default linear interpolation; 0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _stats(name: str, values_s) -> dict:
    ms = [v * 1000.0 for v in values_s]
    out = {
        f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
        f"median_{name}_ms": percentile(ms, 50),
        f"std_{name}_ms": statistics.pstdev(ms) if ms else 0.0,
    }
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = percentile(ms, p)
    return out


def failure(record: RequestRecord) -> Optional[str]:
    """The record's error code, or None when it completed with at least one chunk."""
    if record.error is not None:
        return record.error
    if not record.chunk_times:
        return "empty_stream"
    return None


def compute_metrics(records, duration: Optional[float] = None, slo_ttft_ms: Optional[float] = None,
                    slo_tpot_ms: Optional[float] = None) -> dict:
    """Metrics of one run. duration (s) defaults to the span from the first send to the last event."""
    records = list(records)
    if duration is None:
        starts = [r.send_time for r in records]
        ends = [t for r in records for t in ([r.end_time] if r.end_time is not None else []) + r.chunk_times]
        duration = (max(ends) - min(starts)) if starts and ends else 0.0

    ttfts, tpots, itls, e2els, input_lens, output_lens, errors = [], [], [], [], [], [], []
    itls_per_request, ttfts_per_request = [], []
    errors_by_code: dict = {}
    completed = good = 0
    for r in records:
        code = failure(r)
        errors.append(code or "")
        if code is not None:
            errors_by_code[code] = errors_by_code.get(code, 0) + 1
            input_lens.append(r.prompt_tokens)
            output_lens.append(0)
            ttfts_per_request.append(0.0)
            itls_per_request.append([])
            continue
        completed += 1
        ttft = r.chunk_times[0] - r.send_time
        e2el = r.chunk_times[-1] - r.send_time
        gaps = [b - a for a, b in zip(r.chunk_times, r.chunk_times[1:])]
        tpot = 0.0
        if r.output_tokens > 1:
            tpot = (e2el - ttft) / (r.output_tokens - 1)
            tpots.append(tpot)
        ttfts.append(ttft)
        e2els.append(e2el)
        itls.extend(gaps)
        ttfts_per_request.append(ttft)
        itls_per_request.append(gaps)
        input_lens.append(r.prompt_tokens)
        output_lens.append(r.output_tokens)
        ok = (slo_ttft_ms is None or ttft * 1000.0 <= slo_ttft_ms) and \
             (slo_tpot_ms is None or tpot * 1000.0 <= slo_tpot_ms)
        good += ok

    has_slo = slo_ttft_ms is not None or slo_tpot_ms is not None
    total_in = sum(input_lens[i] for i, e in enumerate(errors) if not e)
    total_cached = sum(r.cached_tokens for r, e in zip(records, errors) if not e)
    later_ttfts = [r.chunk_times[0] - r.send_time for r, e in zip(records, errors) if not e and r.turn >= 2]
    total_out = sum(output_lens)
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    result = {
        "duration": duration,
        "completed": completed,
        "failed": len(records) - completed,
        "errors_by_code": errors_by_code,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(completed),
        "request_goodput": per_s(good) if has_slo else None,
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "good_requests": good if has_slo else None,
        "slo_attainment": (good / len(records) if records else 0.0) if has_slo else None,
        # prefix caching: the share of completed requests' prompt tokens the server had cached
        "total_cached_tokens": total_cached,
        "prefix_hit_rate": total_cached / total_in if total_in else 0.0,
        # multi-turn: the first token of turns 2 and later (their history was seen before)
        "median_ttft_later_turns_ms": percentile([t * 1000.0 for t in later_ttfts], 50) if later_ttfts else None,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        result.update(_stats(name, values))
    result.update({"input_lens": input_lens, "output_lens": output_lens, "ttfts": ttfts_per_request,
                   "itls": itls_per_request, "errors": errors})
    return result
