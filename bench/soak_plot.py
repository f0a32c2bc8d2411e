#!/usr/bin/python3
"""bench/soak_plot.py DIR: the soak's report (scripts/soak). Prints DIR/summary.txt
and, per node, RSS and open file descriptors at the start and end of the run's
second half and their growth per hour there (a node started again counts from
a minute after its last start); draws DIR/soak.png: each request's latency at the time it was
sent (failed ones red), the faults as vertical lines."""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

out = sys.argv[1]
print(open(f"{out}/summary.txt").read(), end="")
rows = list(csv.DictReader(open(f"{out}/resources.csv")))
if rows:
    end = max(float(r["t_s"]) for r in rows)
    print("node       pid     RSS MiB (from, to, per hour)    open fds (from, to, per hour)")
    for node in sorted({r["node"] for r in rows}):
        mine = [r for r in rows if r["node"] == node]
        last_pid = mine[-1]["pid"]
        # (a process started again: from a minute after its start, past its loading)
        born = min(float(r["t_s"]) for r in mine if r["pid"] == last_pid)
        settled = born + 60 if born > 0 else 0
        since = [r for r in mine if r["pid"] == last_pid and float(r["t_s"]) >= max(end / 2, settled)]
        if len(since) < 2:
            print(f"{node:10} {last_pid:7} (started again late in the run: too few samples)")
            continue
        a, b = since[0], since[-1]
        hours = (float(b["t_s"]) - float(a["t_s"])) / 3600
        rss = [int(a["rss_bytes"]) / 2**20, int(b["rss_bytes"]) / 2**20]
        fds = [int(a["fds"]), int(b["fds"])]
        print(f"{node:10} {last_pid:7} {rss[0]:8.1f} {rss[1]:8.1f} {(rss[1] - rss[0]) / hours:+9.1f}"
              f"        {fds[0]:6} {fds[1]:6} {(fds[1] - fds[0]) / hours:+8.1f}")
req = list(csv.DictReader(open(f"{out}/requests.csv")))
faults = list(csv.DictReader(open(f"{out}/faults.csv")))
fig, ax = plt.subplots(figsize=(11, 4))
good = [(float(r["t_s"]), float(r["latency_s"])) for r in req if r["ok"] == "1" and r["tokens_equal"] == "1"]
bad = [(float(r["t_s"]), float(r["latency_s"])) for r in req if not (r["ok"] == "1" and r["tokens_equal"] == "1")]
if good:
    ax.scatter(*zip(*good), s=3, label="ok, colocated tokens")
if bad:
    ax.scatter(*zip(*bad), s=8, color="red", label="failed or other tokens")
for f in faults:
    ax.axvline(float(f["t_s"]), color="grey", lw=0.7)
    ax.text(float(f["t_s"]), ax.get_ylim()[1] * 0.95, f'{f["fault"]}: {f["target"]}', rotation=90, fontsize=6, va="top")
ax.set_xlabel("seconds since start")
ax.set_ylabel("request latency (s)")
ax.set_yscale("log")
ax.legend(loc="lower right", fontsize=7)
fig.tight_layout()
fig.savefig(f"{out}/soak.png", dpi=120)
print(f"{out}/soak.png")
