#!/usr/bin/python3
"""Smoke run of disagg-bench against a real cluster: `scripts/cluster up` with
config/local's nodes on free loopback ports (its own DISAGG_RUN_DIR), 6 requests
at 4 req/s through the HTTP frontend, then `scripts/cluster down`, even on failure.

usage: smoke_test.py SOURCE_DIR BIN_DIR"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

PORT_LINE = re.compile(r"^(\s*[a-z-]*port\s*=\s*)(\d+)", re.MULTILINE)


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from ports import free_port  # noqa: E402  (below the ephemeral range: no race with port-0 sockets)


def copy_config(src: str, dst: str) -> None:
    """config/local with every port number replaced by a free one (the same number -> the same port)."""
    ports = {}
    for name in sorted(os.listdir(src)):
        if name.endswith(".ini"):
            with open(os.path.join(src, name)) as f:
                text = f.read()
            text = PORT_LINE.sub(lambda m: m.group(1) + str(ports.setdefault(m.group(2), free_port())), text)
            with open(os.path.join(dst, name), "w") as f:
                f.write(text)


def main() -> int:
    source, bin_dir = sys.argv[1], sys.argv[2]
    work = tempfile.mkdtemp(prefix="disagg-bench-smoke-")
    config, run_dir = os.path.join(work, "config"), os.path.join(work, "run")
    os.makedirs(config)
    copy_config(os.path.join(source, "config", "local"), config)
    env = dict(os.environ, DISAGG_RUN_DIR=run_dir, DISAGG_BIN_DIR=bin_dir)
    cluster = os.path.join(source, "scripts", "cluster")
    ok = False
    try:
        up = subprocess.run([cluster, "up", config], env=env, capture_output=True, text=True, timeout=180)
        print(up.stdout + up.stderr)
        if up.returncode != 0:
            print("FAIL: scripts/cluster up failed")
            return 1
        http = re.search(r"^http=(\S+)$", up.stdout, re.MULTILINE).group(1)
        result_file, plot = os.path.join(work, "result.json"), os.path.join(work, "plot.png")
        bench = subprocess.run(
            [os.path.join(source, "bench", "disagg-bench"), "--base-url", f"http://{http}", "--num-prompts", "6",
             "--request-rate", "4", "--num-warmups", "1", "--input-len", "32", "--output-len", "16",
             "--range-ratio", "0.5", "--seed", "1", "--slo-ttft-ms", "10000", "--slo-tpot-ms", "10000",
             "--timeout", "60", "--result-file", result_file, "--plot", plot],
            capture_output=True, text=True, timeout=300)
        print(bench.stdout + bench.stderr)
        if bench.returncode != 0:
            print("FAIL: disagg-bench exited with", bench.returncode)
            return 1
        with open(result_file) as f:
            results = json.load(f)["results"]
        problems = []
        if len(results) != 1:
            problems.append(f"{len(results)} results, expected 1")
        r = results[0]
        for key in ("completed", "failed", "errors_by_code", "duration", "request_throughput", "output_throughput",
                    "request_goodput", "slo_attainment", "total_input_tokens", "total_output_tokens",
                    "input_lens", "output_lens", "ttfts", "itls", "errors") + tuple(
                        f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
                        for s in ("mean", "median", "std", "p50", "p90", "p99")):
            if key not in r:
                problems.append(f"no field {key}")
        if not problems:
            if r["completed"] != 6 or r["failed"] != 0 or r["errors_by_code"]:
                problems.append(f"completed {r['completed']}, failed {r['failed']} {r['errors_by_code']}")
            if r["request_rate"] != 4 or r["slo_attainment"] != 1.0:
                problems.append(f"request_rate {r['request_rate']}, slo_attainment {r['slo_attainment']}")
            if not (0 < r["p50_ttft_ms"] <= r["p90_ttft_ms"] <= r["p99_ttft_ms"] <= r["p99_e2el_ms"]):
                problems.append("TTFT percentiles out of order")
            if not all(1 <= n <= 24 for n in r["output_lens"]) or r["total_output_tokens"] != sum(r["output_lens"]):
                problems.append(f"output_lens {r['output_lens']}")
        with open(plot, "rb") as f:
            if f.read(8) != b"\x89PNG\r\n\x1a\n":
                problems.append("the plot is not a PNG")
        # The prefix-caching workloads: turns 2+ of a conversation and the later requests of a
        # group find their history's blocks cached (usage.prompt_tokens_details.cached_tokens).
        for name, extra in (("multi-turn", ["--conversations", "2", "--turns", "3", "--system-len", "60",
                                            "--user-len", "8", "--output-len", "8"]),
                            ("shared-prefix", ["--groups", "2", "--num-prompts", "6", "--prefix-len", "64",
                                               "--input-len", "8", "--output-len", "4", "--max-concurrency", "1"])):
            out = os.path.join(work, name + ".json")
            run = subprocess.run([os.path.join(source, "bench", "disagg-bench"), "--base-url", f"http://{http}",
                                  "--workload", name, "--seed", "2", "--timeout", "60", "--result-file", out] + extra,
                                 capture_output=True, text=True, timeout=300)
            print(run.stdout + run.stderr)
            if run.returncode != 0:
                problems.append(f"{name}: disagg-bench exited with {run.returncode}")
                continue
            with open(out) as f:
                w = json.load(f)["results"][0]
            if w["failed"] != 0 or w["completed"] != 6:
                problems.append(f"{name}: completed {w['completed']}, failed {w['failed']}")
            if not w["prefix_hit_rate"] > 0.3:
                problems.append(f"{name}: prefix hit rate {w['prefix_hit_rate']}")
        for p in problems:
            print("FAIL:", p)
        if not problems:
            print("OK: 6 requests at 4 req/s, 0 failed, every field, a PNG; multi-turn and shared-prefix hit the cache")
        ok = not problems
        return 0 if ok else 1
    finally:
        down = subprocess.run([cluster, "down"], env=env, capture_output=True, text=True, timeout=60)
        print(down.stdout + down.stderr)
        if ok and down.returncode == 0:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"logs and results kept in {work}")


if __name__ == "__main__":
    sys.exit(main())
