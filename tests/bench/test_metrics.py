#!/usr/bin/python3
"""disagg-bench's metric computations against values worked out by hand on a
small recorded stream (bench/disagg_bench/metrics.py has the definitions), and
`scripts/bench compare`'s goodput at 90% attainment, plan and summary against
hand-computed values from made-up sweeps (bench/disagg_bench/compare.py)."""

import math
import os
import random
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))

from disagg_bench import compare  # noqa: E402
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


    def test_prefix_hit_rate_and_later_turns(self):
        # Three turns of a conversation (prompts 100, 150, 200 tokens; 0, 96, 144 cached) and a failed
        # fourth whose cached tokens do not count: 240 / 450 of the completed prompts' tokens; the
        # median TTFT of turns 2+ is that of turns 2 and 3 (200 and 100 ms -> 150).
        records = [RequestRecord(0.0, [0.5], 100, 1, None, 0.5, 0, "", 1),
                   RequestRecord(1.0, [1.2], 150, 1, None, 1.2, 96, "", 2),
                   RequestRecord(2.0, [2.1], 200, 1, None, 2.1, 144, "", 3),
                   RequestRecord(3.0, [], 250, 0, "503 overloaded", 3.1, 192, "", 4)]
        m = compute_metrics(records)
        self.assertEqual(m["total_cached_tokens"], 240)
        self.assertAlmostEqual(m["prefix_hit_rate"], 240 / 450)
        self.assertAlmostEqual(m["median_ttft_later_turns_ms"], 150.0)
        self.assertIsNone(compute_metrics(STREAM)["median_ttft_later_turns_ms"])

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




def sweep(points, **fields):
    """Made-up disagg-bench results: (rate, attainment) each, plus fields."""
    return [dict({"request_rate": r, "slo_attainment": a}, **fields) for r, a in points]


class GoodputAtAttainment(unittest.TestCase):
    def test_interpolates_where_attainment_falls_through_90(self):
        # 2 req/s reaches 95%, 4 req/s 80%: swept 2; 90% lies 0.05/0.15 = 1/3 of the way to 4: 2.667
        g = compare.goodput_at_attainment(sweep([(1, 1.0), (2, 0.95), (4, 0.8), (8, 0.2)]))
        self.assertEqual(g["swept"], 2)
        self.assertAlmostEqual(g["interpolated"], 2 + 2 / 3, places=9)
        self.assertFalse(g["capped"])

    def test_order_of_the_results_does_not_matter(self):
        g = compare.goodput_at_attainment(sweep([(8, 0.2), (2, 0.95), (1, 1.0), (4, 0.8)]))
        self.assertAlmostEqual(g["interpolated"], 2 + 2 / 3, places=9)

    def test_exactly_90_percent_counts(self):
        g = compare.goodput_at_attainment(sweep([(1, 1.0), (3, 0.9), (5, 0.5)]))
        self.assertEqual(g["swept"], 3)
        self.assertAlmostEqual(g["interpolated"], 3.0, places=9)

    def test_every_rate_meets_it_capped_at_the_top_rate(self):
        g = compare.goodput_at_attainment(sweep([(0.5, 1.0), (1, 0.97), (2, 0.91)]))
        self.assertEqual((g["swept"], g["interpolated"], g["capped"]), (2, 2, True))

    def test_lowest_rate_misses_it_zero(self):
        g = compare.goodput_at_attainment(sweep([(1, 0.85), (2, 0.95)]))
        self.assertEqual((g["swept"], g["interpolated"], g["capped"]), (0.0, 0.0, False))

    def test_a_rate_above_a_miss_does_not_count(self):
        # 4 req/s reaches 95% after 2 req/s missed (50%): the goodput stays between 1 and 2,
        # 1 + 1 * (1.0 - 0.9) / (1.0 - 0.5) = 1.2
        g = compare.goodput_at_attainment(sweep([(1, 1.0), (2, 0.5), (4, 0.95)]))
        self.assertEqual(g["swept"], 1)
        self.assertAlmostEqual(g["interpolated"], 1.2, places=9)

    def test_failed_requests_lower_attainment_through_compute_metrics(self):
        # STREAM at SLOs TTFT <= 250, TPOT <= 80: A, C good (B's TPOT 100, F's TTFT 400; D, E failed): 2/6
        m = compute_metrics(STREAM, slo_ttft_ms=250, slo_tpot_ms=80)
        m["request_rate"] = 1.0
        g = compare.goodput_at_attainment([m, {"request_rate": 0.5, "slo_attainment": 1.0}])
        # between (0.5, 1.0) and (1.0, 1/3): 0.5 + 0.5 * 0.1 / (2/3) = 0.575
        self.assertAlmostEqual(g["interpolated"], 0.575, places=9)

    def test_results_without_slos_are_refused(self):
        with self.assertRaises(ValueError):
            compare.goodput_at_attainment(sweep([(1, None)]))


class CompareSummary(unittest.TestCase):
    FIELDS = {"slo_ttft_ms": 100.0, "slo_tpot_ms": 10.0}

    def results(self, points, ttft_means, p90_ttfts, p90_tpots):
        out = sweep(points, **self.FIELDS)
        for r, mean, t90, p90 in zip(out, ttft_means, p90_ttfts, p90_tpots):
            r.update(mean_ttft_ms=mean, p90_ttft_ms=t90, p90_tpot_ms=p90)
        return out

    def test_side_by_side_ratios_and_the_headline_sum(self):
        sweeps = {
            "prefill-heavy": {
                # disagg: 90% between 2 (1.0) and 4 (0.8): 2 + 2 * 0.1 / 0.2 = 3
                "disagg": self.results([(1, 1.0), (2, 1.0), (4, 0.8)], [30, 40, 90], [50, 60, 200], [4, 5, 9]),
                # colocated: between 1 (0.95) and 2 (0.7): 1 + 0.05 / 0.25 = 1.2
                "colocated": self.results([(1, 0.95), (2, 0.7), (4, 0.1)], [20, 60, 300], [40, 90, 500],
                                          [8, 12, 30])},
            "decode-heavy": {
                "disagg": self.results([(1, 1.0), (2, 1.0), (4, 0.95)], [10, 11, 12], [15, 16, 17], [5, 6, 7]),
                "colocated": self.results([(1, 0.5), (2, 0.4), (4, 0.1)], [10, 11, 12], [15, 16, 17], [5, 6, 7])},
        }
        s = compare.summarize(sweeps)
        p, d = s["mixes"]["prefill-heavy"], s["mixes"]["decode-heavy"]
        self.assertAlmostEqual(p["disagg"]["goodput"], 3.0, places=9)
        self.assertAlmostEqual(p["colocated"]["goodput"], 1.2, places=9)
        self.assertAlmostEqual(p["ratio"]["goodput"], 2.5, places=9)
        self.assertEqual((p["disagg"]["goodput_swept"], p["colocated"]["goodput_swept"]), (2, 1))
        self.assertAlmostEqual(p["ratio"]["mean_ttft_ms_lowest_rate"], 1.5, places=9)  # 30 / 20
        self.assertAlmostEqual(p["ratio"]["p90_ttft_ms_lowest_rate"], 1.25, places=9)  # 50 / 40
        self.assertAlmostEqual(p["ratio"]["p90_tpot_ms_lowest_rate"], 0.5, places=9)  # 4 / 8
        self.assertTrue(d["disagg"]["goodput_capped"])
        self.assertEqual(d["ratio"]["goodput"], "inf")  # 4 / 0
        # headline: disagg 3 + 4 = 7, colocated 1.2 + 0 = 1.2, ratio 5.833
        self.assertAlmostEqual(s["goodput"]["disagg"], 7.0, places=9)
        self.assertAlmostEqual(s["goodput"]["colocated"], 1.2, places=9)
        self.assertEqual(compare.final_line(s), "goodput disagg=7 colocated=1.2 ratio=5.83")
        self.assertIn(">=4", compare.table(s))  # capped goodput is marked

    def test_both_zero_ratio_is_not_a_number(self):
        zero = self.results([(1, 0.5), (2, 0.1)], [1, 1], [1, 1], [1, 1])
        s = compare.summarize({"prefill-heavy": {"disagg": zero, "colocated": zero}})
        self.assertEqual(s["goodput"]["ratio"], "n/a")
        self.assertEqual(compare.final_line(s), "goodput disagg=0 colocated=0 ratio=n/a")


class ComparePlan(unittest.TestCase):
    def test_rates_prompts_and_slos_from_the_probe(self):
        # capacity 10 req/s: rates 0.25, 0.5, 1, 1.5, 2, 3 x 10; one sweep takes (4 + 2 + 1 + 1 + 1 + 1)
        # = 10 units of num_prompts / capacity (a rate past the capacity: 1 unit): 33 s -> 33 prompts
        unloaded = {"median_ttft_ms": 12.0, "median_tpot_ms": 0.5}
        plan = compare.plan_mix("prefill-heavy", unloaded, {"request_throughput": 10.0}, 33.0)
        self.assertEqual(plan["rates"], [2.5, 5.0, 10.0, 15.0, 20.0, 30.0])
        self.assertEqual(plan["num_prompts"], 33)
        self.assertEqual(plan["slo_ttft_ms"], 48.0)  # 4 x 12
        self.assertEqual(plan["slo_tpot_ms"], 5.0)  # 4 x 0.5 = 2, below the 5 ms floor
        self.assertEqual(compare.plan_mix("decode-heavy", unloaded, {"request_throughput": 10.0}, 6000.0)
                         ["num_prompts"], 400)  # at most 400
        given = compare.plan_mix("decode-heavy", unloaded, {"request_throughput": 0.1234}, 33.0,
                                 slo_ttft_ms=700.0, slo_tpot_ms=30.0)
        self.assertEqual((given["slo_ttft_ms"], given["slo_tpot_ms"]), (700.0, 30.0))
        # two significant digits: 0.03085, 0.0617, 0.1234, 0.1851, 0.2468, 0.3702
        self.assertEqual(given["rates"], [0.031, 0.062, 0.12, 0.19, 0.25, 0.37])
        self.assertEqual(given["num_prompts"], 10)  # at least 10
        with self.assertRaises(ValueError):
            compare.plan_mix("decode-heavy", unloaded, {"request_throughput": 0.0}, 30.0)

    def test_mix_lengths_fit_the_context(self):
        for seq_len in (64, 256, 512, 2048):
            for mix, m in compare.mix_lengths(seq_len).items():
                longest = int(m["input_len"] * 1.25) + int(m["output_len"] * 1.25)
                self.assertLessEqual(longest, seq_len, (seq_len, mix))
        lengths = compare.mix_lengths(512)
        self.assertEqual((lengths["prefill-heavy"]["input_len"], lengths["prefill-heavy"]["output_len"]), (307, 16))
        self.assertEqual((lengths["decode-heavy"]["input_len"], lengths["decode-heavy"]["output_len"]), (32, 128))


if __name__ == "__main__":
    unittest.main()
