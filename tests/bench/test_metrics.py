#!/usr/bin/python3
"""disagg-bench's metric computations against values worked out by hand on a
small recorded stream (bench/disagg_bench/metrics.py has the definitions)."""

import math
import os
import random
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))

from disagg_bench.load import arrival_gaps, make_prompts  # noqa: E402
from disagg_bench.metrics import RequestRecord, compute_metrics, percentile  # noqa: E402

# Six requests (times in s). Per completed request, by hand:
#   A: sent 0.0, chunks 0.10 0.15 0.25 0.30, 4 tokens
#      TTFT 100 ms, E2EL 300 ms, TPOT (300-100)/(4-1) = 66.667 ms, ITL 50 100 50
#   B: sent 1.0, chunks 1.20 1.30, 2 tokens
#      TTFT 200, E2EL 300, TPOT 100/1 = 100, ITL 100
#   C: sent 2.0, one chunk 2.05, 1 token
#      TTFT 50, E2EL 50, no TPOT (counts as 0 for the SLO), no ITL
#   D: sent 2.5, HTTP 503 overloaded at 2.51: failed
#   E: sent 3.0, one chunk at 3.1, then an in-band worker_lost at 3.5: failed
#   F: sent 3.0, chunks 3.40 3.50 3.65, 5 tokens (a chunk may carry several)
#      TTFT 400, E2EL 650, TPOT (650-400)/(5-1) = 62.5, ITL 100 150
STREAM = [
    RequestRecord(0.0, [0.10, 0.15, 0.25, 0.30], 10, 4, None, 0.30),
    RequestRecord(1.0, [1.20, 1.30], 10, 2, None, 1.30),
    RequestRecord(2.0, [2.05], 10, 1, None, 2.05),
    RequestRecord(2.5, [], 10, 0, "503 overloaded", 2.51),
    RequestRecord(3.0, [3.1], 10, 1, "stream worker_lost", 3.5),
    RequestRecord(3.0, [3.40, 3.50, 3.65], 10, 5, None, 3.65),
]


class HandComputedStream(unittest.TestCase):
    def assertFields(self, got, expected):
        for key, value in expected.items():
            with self.subTest(field=key):
                if value is None or isinstance(value, (dict, list, str)):
                    self.assertEqual(got[key], value)
                else:
                    self.assertAlmostEqual(got[key], value, places=6)

    def test_counts_and_throughputs(self):
        m = compute_metrics(STREAM, duration=4.0)
        # 4 completed in 4 s; 4+2+1+5 = 12 output tokens; 4 x 10 prompt tokens of completed requests.
        self.assertFields(m, {
            "completed": 4, "failed": 2, "errors_by_code": {"503 overloaded": 1, "stream worker_lost": 1},
            "total_input_tokens": 40, "total_output_tokens": 12,
            "request_throughput": 1.0, "output_throughput": 3.0, "total_token_throughput": 13.0,
            "request_goodput": None, "slo_attainment": None,
            "output_lens": [4, 2, 1, 0, 0, 5],
            "errors": ["", "", "", "503 overloaded", "stream worker_lost", ""],
        })

    def test_duration_defaults_to_first_send_to_last_event(self):
        self.assertAlmostEqual(compute_metrics(STREAM)["duration"], 3.65)  # 0.0 .. F's last chunk

    def test_ttft(self):
        # sorted 50 100 200 400: mean 750/4; p50 rank 1.5 -> 100 + 0.5*100; p90 rank 2.7 -> 200 + 0.7*200;
        # p99 rank 2.97 -> 200 + 0.97*200
        self.assertFields(compute_metrics(STREAM, 4.0), {
            "mean_ttft_ms": 187.5, "median_ttft_ms": 150.0, "p50_ttft_ms": 150.0,
            "p90_ttft_ms": 340.0, "p99_ttft_ms": 394.0})

    def test_tpot(self):
        # A 66.667, B 100, F 62.5 (C has one token: none). sorted 62.5 66.667 100: mean 229.1667/3;
        # p50 66.667; p90 rank 1.8 -> 66.667 + 0.8*33.333; p99 rank 1.98 -> 66.667 + 0.98*33.333
        self.assertFields(compute_metrics(STREAM, 4.0), {
            "mean_tpot_ms": 229.1666667 / 3, "p50_tpot_ms": 200 / 3,
            "p90_tpot_ms": 200 / 3 + 0.8 * 100 / 3, "p99_tpot_ms": 200 / 3 + 0.98 * 100 / 3})

    def test_itl(self):
        # every gap of the completed requests: 50 100 50 | 100 | 100 150, sorted 50 50 100 100 100 150:
        # mean 550/6; p50 rank 2.5 -> 100; p90 rank 4.5 -> 100 + 0.5*50; p99 rank 4.95 -> 100 + 0.95*50
        m = compute_metrics(STREAM, 4.0)
        self.assertFields(m, {"mean_itl_ms": 550 / 6, "p50_itl_ms": 100.0, "p90_itl_ms": 125.0,
                              "p99_itl_ms": 147.5})
        self.assertEqual(len(m["itls"]), 6)
        self.assertEqual([len(g) for g in m["itls"]], [3, 1, 0, 0, 0, 2])

    def test_e2el(self):
        # 300 300 50 650, sorted 50 300 300 650: mean 325; p50 300; p90 rank 2.7 -> 300 + 0.7*350;
        # p99 rank 2.97 -> 300 + 0.97*350
        self.assertFields(compute_metrics(STREAM, 4.0), {
            "mean_e2el_ms": 325.0, "p50_e2el_ms": 300.0, "p90_e2el_ms": 545.0, "p99_e2el_ms": 639.5})

    def test_goodput_needs_every_slo(self):
        # TTFT <= 200 and TPOT <= 70: A (100, 66.7) good; B (200, 100) misses TPOT; C (50, -) good;
        # F (400, 62.5) misses TTFT; D and E failed. 2 good: 2/4 s = 0.5 req/s, 2 of 6 requests.
        self.assertFields(compute_metrics(STREAM, 4.0, slo_ttft_ms=200, slo_tpot_ms=70),
                          {"good_requests": 2, "request_goodput": 0.5, "slo_attainment": 2 / 6})
        # TTFT only: A, B (200 is within), C: 3 good
        self.assertFields(compute_metrics(STREAM, 4.0, slo_ttft_ms=200),
                          {"good_requests": 3, "request_goodput": 0.75, "slo_attainment": 0.5})
        # TPOT only: A, C, F: 3 good
        self.assertFields(compute_metrics(STREAM, 4.0, slo_tpot_ms=70),
                          {"good_requests": 3, "request_goodput": 0.75, "slo_attainment": 0.5})

    def test_a_completed_request_without_chunks_failed(self):
        m = compute_metrics([RequestRecord(0.0, [], 5, 0, None, 1.0)])
        self.assertFields(m, {"completed": 0, "failed": 1, "errors_by_code": {"empty_stream": 1},
                              "mean_ttft_ms": 0.0, "p99_ttft_ms": 0.0})


class Percentile(unittest.TestCase):
    def test_equals_numpy_linear_interpolation(self):
        import numpy
        rng = random.Random(7)
        for n in (1, 2, 3, 10, 101):
            values = [rng.uniform(0, 100) for _ in range(n)]
            for p in (0, 50, 90, 99, 100):
                self.assertAlmostEqual(percentile(values, p), float(numpy.percentile(values, p)), places=9)


class Workload(unittest.TestCase):
    def test_poisson_and_gamma_arrivals(self):
        n = 20001
        for burstiness in (1.0, 0.25, 4.0):
            gaps = arrival_gaps(n, 4.0, burstiness, seed=1)
            mean = sum(gaps) / len(gaps)
            cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
            self.assertAlmostEqual(mean, 0.25, delta=0.25 * 0.05)  # mean 1/rate
            self.assertAlmostEqual(cv, 1 / math.sqrt(burstiness), delta=0.05 / math.sqrt(burstiness))
        self.assertEqual(arrival_gaps(5, math.inf, 1.0, 0), [0.0] * 4)
        self.assertEqual(arrival_gaps(5, 2.0, 1.0, 3), arrival_gaps(5, 2.0, 1.0, 3))

    def test_prompt_lengths_fixed_or_uniform_and_seeded(self):
        fixed = make_prompts(50, 32, 8, 0.0, 1, "tokens", 512)
        self.assertTrue(all(len(p.prompt) == 32 and p.output_len == 8 for p in fixed))
        self.assertTrue(all(3 <= t < 512 for p in fixed for t in p.prompt))
        uniform = make_prompts(400, 100, 20, 0.5, 2, "tokens", 512)
        self.assertEqual({p.input_len for p in uniform} - set(range(50, 151)), set())
        self.assertLess(min(p.input_len for p in uniform), 60)
        self.assertGreater(max(p.input_len for p in uniform), 140)
        self.assertEqual([p.prompt for p in uniform], [p.prompt for p in make_prompts(400, 100, 20, 0.5, 2, "tokens", 512)])
        text = make_prompts(3, 10, 4, 0.0, 3, "text", 512)
        self.assertTrue(all(isinstance(p.prompt, str) and len(p.prompt.split()) == 10 for p in text))


if __name__ == "__main__":
    unittest.main()
