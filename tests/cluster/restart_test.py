#!/usr/bin/python3
"""A crashed node comes back: config/local's nodes on free loopback ports (each
phase with its own DISAGG_RUN_DIR, as bench.smoke does), then

  restart:   SIGKILL the frontend; `scripts/cluster restart frontend` and it
             serves the same completion again; SIGKILL a decode node and the
             frontend; `scripts/cluster up` starts only those two;
  supervise: `SUPERVISE=1 scripts/cluster up`; SIGKILL the frontend, then the
             router: each time the supervisor starts it again by itself and a
             completion is served again, with no command from the test; a
             supervised node that `restart` started comes back too.

Every wait polls for its event until a deadline. `scripts/cluster down` runs at
the end of each phase, also on failure, and no process of the run dir is left.

usage: restart_test.py SOURCE_DIR BIN_DIR
       restart_test.py --systemd SOURCE_DIR BIN_DIR   (systemd-analyze verify of
                                                      config/systemd/; exit 77: no such tool)"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

PROMPT = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
# Every wait and command of the phases ends by this many seconds after the
# start, so that `down` still runs within ctest's TIMEOUT (600 s).
BUDGET_S = 420
DEADLINE = time.monotonic() + BUDGET_S


def bounded(timeout):
    """timeout, cut to what is left of the test's budget (at least 5 s)."""
    return max(5.0, min(timeout, DEADLINE - time.monotonic()))


class Failure(Exception):
    pass


def check(condition, message):
    if not condition:
        raise Failure(message)


def alive(pid):
    """The process has a thread that has not exited (an unreaped zombie has
    none; one whose main thread exited while others still end has)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X", "x"):
            return True
    return False


def wait_for(what, predicate, timeout):
    """Polls predicate until it returns something true; fails after timeout seconds."""
    deadline = time.monotonic() + bounded(timeout)
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise Failure(f"{what}: not within {timeout} s")
        time.sleep(0.05)


def complete(http):
    """(status, text) of one completion; status 0 when nothing answers."""
    request = urllib.request.Request(f"http://{http}/v1/completions", data=json.dumps(PROMPT).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.load(r)["choices"][0]["text"]
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (OSError, ValueError):
        return 0, ""


class Cluster:
    def __init__(self, source, bin_dir, work, phase, extra_env=None):
        sys.path.insert(0, os.path.join(source, "tests", "bench"))
        from smoke_test import copy_config  # config/local on free ports, as bench.smoke runs it

        self.config, self.run_dir = os.path.join(work, phase, "config"), os.path.join(work, phase, "run")
        os.makedirs(self.config)
        copy_config(os.path.join(source, "config", "local"), self.config)
        self.script = os.path.join(source, "scripts", "cluster")
        self.env = dict(os.environ, DISAGG_RUN_DIR=self.run_dir, DISAGG_BIN_DIR=bin_dir, CLUSTER_TIMEOUT="60",
                        **(extra_env or {}))
        self.seen = set()  # every node and supervisor pid this phase saw, to check that none is left
        self.http = None

    def cluster(self, *args, timeout=150, env=None):
        r = subprocess.run([self.script, *args], env=dict(self.env, **(env or {})), capture_output=True,
                           text=True, timeout=bounded(timeout))
        print(f"$ scripts/cluster {' '.join(args)}  -> {r.returncode}\n{r.stdout}{r.stderr}", flush=True)
        return r

    def up(self, env=None):
        r = self.cluster("up", self.config, env=env)
        check(r.returncode == 0, "scripts/cluster up failed")
        self.http = re.search(r"^http=(\S+)$", r.stdout, re.MULTILINE).group(1)
        return r

    def pid(self, name, kind="pid"):
        try:
            with open(os.path.join(self.run_dir, f"{name}.{kind}")) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            return None
        if alive(pid):
            self.seen.add(pid)
            return pid
        return None

    def kill(self, name):
        """SIGKILL node `name` (its pid file names a process of this run dir) and waits until it is gone."""
        pid = self.pid(name)
        check(pid is not None, f"{name} does not run")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            check(f"--node.ready-file={self.run_dir}/{name}.ready".encode() in f.read().split(b"\0"),
                  f"pid {pid} is not {name} of {self.run_dir}")
        os.kill(pid, signal.SIGKILL)
        wait_for(f"{name} (pid {pid}) gone after SIGKILL", lambda: not alive(pid), 10)
        print(f"killed {name} (pid {pid})", flush=True)
        return pid

    def served(self, what, expected, timeout=60):
        """Polls the frontend until a completion is served; returns how long that took."""
        start = time.monotonic()
        codes, bodies = [], {}

        def ok():
            status, text = complete(self.http)
            if not codes or codes[-1] != status:
                codes.append(status)
            if status not in (0, 200):
                bodies.setdefault(status, text)
            return status == 200 and text == expected

        try:
            wait_for(f"{what}: a completion again", ok, timeout)
        except Failure as e:
            raise Failure(f"{e} (answers seen: {codes}; first bodies: {bodies})") from None
        took = time.monotonic() - start
        print(f"{what}: served again after {took:.2f} s (answers in between: {codes})", flush=True)
        for status, body in sorted(bodies.items()):
            print(f"  first {status}: {body.strip()[:300]}", flush=True)
        return took

    def down(self):
        try:
            r = subprocess.run([self.script, "down"], env=self.env, capture_output=True, text=True, timeout=60)
            print(f"$ scripts/cluster down  -> {r.returncode}\n{r.stdout}{r.stderr}", flush=True)
            code = r.returncode
        except subprocess.TimeoutExpired:
            print("scripts/cluster down did not end within 60 s", flush=True)
            code = None
        left = [p for p in self.seen if alive(p)]
        return code == 0 and not left, left

    def log(self, name):
        try:
            with open(os.path.join(self.run_dir, f"{name}.log")) as f:
                return f.read()
        except OSError:
            return ""


def restart_phase(c):
    c.up()
    status, expected = complete(c.http)
    check(status == 200 and expected, f"first completion: {status} {expected!r}")
    print(f"completion: {expected!r}", flush=True)
    pids = {n: c.pid(n) for n in ("router", "prefill-1", "prefill-2", "decode-1", "decode-2", "frontend")}
    check(all(pids.values()), f"pids {pids}")

    # (a) A killed frontend serves nothing until `restart frontend` starts it again.
    c.kill("frontend")
    check(complete(c.http)[0] == 0, "something still answers at the killed frontend's address")
    start = time.monotonic()
    r = c.cluster("restart", "frontend", timeout=120)
    check(r.returncode == 0, "scripts/cluster restart frontend failed")
    check(f"http={c.http}" in r.stdout, "restart did not print the frontend's address")
    print(f"restart frontend took {time.monotonic() - start:.2f} s", flush=True)
    new = c.pid("frontend")
    check(new and new != pids["frontend"], f"frontend pid {new} after restart (was {pids['frontend']})")
    status, text = complete(c.http)
    check(status == 200 and text == expected, f"after restart: {status} {text!r}")

    # Restarting a running node stops it first (no second process on its port).
    r = c.cluster("restart", "frontend", timeout=120)
    check(r.returncode == 0 and "stopped frontend" in r.stdout, "restart of a running frontend failed")
    check(not alive(new), f"the frontend before the restart (pid {new}) still runs")
    check(c.cluster("restart", "nosuch").returncode == 1, "restart of an unknown node succeeded")

    # `up` on a partly running cluster starts only the missing nodes.
    c.kill("decode-1")
    c.kill("frontend")
    r = c.cluster("up", c.config)
    check(r.returncode == 0, "up of a partly running cluster failed")
    check("starting decode-1 frontend" in r.stdout, "up did not say it starts only decode-1 and frontend")
    for name in ("router", "prefill-1", "prefill-2", "decode-2"):
        check(c.pid(name) == pids[name], f"up started {name} again")
    check(c.pid("decode-1") not in (None, pids["decode-1"]), "decode-1 did not come back")
    status, text = complete(c.http)
    check(status == 200 and text == expected, f"after a partial up: {status} {text!r}")
    # Every node runs: `up` refuses as before.
    r = c.cluster("up", c.config)
    check(r.returncode == 1 and "already running" in r.stderr, "a second up of a whole cluster did not refuse")

    # `down` returns once every node has exited, so that `down; up` never
    # races the old nodes: a stopped node (it cannot act on SIGTERM) is
    # killed after STOP_TIMEOUT, and waited for.
    stopped = c.pid("decode-2")
    os.kill(stopped, signal.SIGSTOP)
    start = time.monotonic()
    try:
        # 12 s: STOP_TIMEOUT, the kill and the others' exits, on a busy machine.
        r = c.cluster("down", env={"STOP_TIMEOUT": "2"}, timeout=12)
    except subprocess.TimeoutExpired:
        os.kill(stopped, signal.SIGKILL)  # (the node this test stopped), so that the cleanup's down ends
        raise Failure("down did not return within 12 s with STOP_TIMEOUT=2 and one stopped node") from None
    took = time.monotonic() - start
    left = [p for p in c.seen if alive(p)]
    check(r.returncode == 0, "down failed")
    check(not left, f"down returned while {left} still ran")
    check("did not end within 2 s of SIGTERM; killing it" in r.stderr, "down did not say it killed the stopped node")
    check(1 <= took, f"down took {took:.1f} s with STOP_TIMEOUT=2 (whole seconds of bash: 1-2 s) and one stopped node")


def supervise_phase(c):
    c.up()
    status, expected = complete(c.http)
    check(status == 200 and expected, f"first completion: {status} {expected!r}")
    for name in ("router", "prefill-1", "prefill-2", "decode-1", "decode-2", "frontend"):
        check(c.pid(name, "supervisor"), f"{name} has no supervisor")
        check(c.pid(name), f"{name} does not run")

    # (b) The frontend, killed, comes back by itself.
    old = c.kill("frontend")
    c.served("frontend killed", expected)
    new = c.pid("frontend")
    check(new and new != old, f"frontend pid {new} (was {old})")
    check("frontend failed (signal KILL)" in c.log("frontend"), "the supervisor did not log the failure")

    # The router, killed, comes back by itself; the workers register with it
    # again and the frontend reaches it again.
    old = c.kill("router")
    c.served("router killed", expected)
    new = c.pid("router")
    check(new and new != old, f"router pid {new} (was {old})")
    wait_for("every worker registered with the restarted router",
             lambda: "workers prefill=2 decode=2" in c.cluster("status", timeout=30).stdout, 30)
    # The frontend's view: it lost the router and reached it again.
    log = c.log("frontend")
    check("lost the router" in log and log.count("connected to the router") >= 2,
          "the frontend's log does not show it reaching the restarted router")

    # `restart` of a supervised node: a new supervisor, which brings it back too.
    old_supervisor = c.pid("frontend", "supervisor")
    r = c.cluster("restart", "frontend", timeout=120)
    check(r.returncode == 0 and "supervised" in r.stdout, "restart of a supervised frontend failed")
    check(not alive(old_supervisor), "the frontend's old supervisor still runs")
    check(c.pid("frontend", "supervisor"), "the restarted frontend has no supervisor")
    old = c.kill("frontend")
    c.served("restarted frontend killed", expected)
    check(c.pid("frontend") not in (None, old), "the restarted frontend did not come back")


def systemd_check(source, bin_dir):
    tool = shutil.which("systemd-analyze")
    if not tool:
        print("SKIP: no systemd-analyze (apt-get install systemd)")
        return 77
    units = os.path.join(source, "config", "systemd")
    work = tempfile.mkdtemp(prefix="disagg-systemd-")
    try:
        # The units as installed (config/README.md), pointed at this checkout.
        for name in os.listdir(units):
            if name.endswith((".service", ".target")):
                with open(os.path.join(units, name)) as f:
                    text = f.read().replace("/opt/disagg/build/bin", bin_dir).replace("/opt/disagg", source)
                with open(os.path.join(work, name), "w") as f:
                    f.write(text)
        instances = [os.path.join(work, f"disagg-node@{n}.service") for n in ("router", "prefill-1", "frontend")]
        r = subprocess.run([tool, "verify", "--man=no", *instances, os.path.join(work, "disagg.target")],
                           capture_output=True, text=True, timeout=60, cwd=work)
        print(r.stdout + r.stderr)
        # verify exits 0 on unknown keys and bad values too, printing a warning.
        if r.returncode != 0 or r.stdout.strip() or r.stderr.strip():
            print("FAIL: systemd-analyze verify found problems")
            return 1
        print("OK: systemd-analyze verify of disagg-node@.service and disagg.target")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main():
    if sys.argv[1] == "--systemd":
        return systemd_check(sys.argv[2], sys.argv[3])
    source, bin_dir = sys.argv[1], sys.argv[2]
    work = tempfile.mkdtemp(prefix="disagg-restart-")
    failed = False
    start = time.monotonic()
    for phase, extra_env, run in (("restart", {"SUPERVISE": "0"}, restart_phase),
                                  ("supervise", {"SUPERVISE": "1", "SUPERVISE_BACKOFF_MS": "200"},
                                   supervise_phase)):
        print(f"==== {phase}", flush=True)
        c = Cluster(source, bin_dir, work, phase, extra_env)
        try:
            run(c)
            print(f"OK: {phase}", flush=True)
        except (Failure, subprocess.TimeoutExpired, AttributeError) as e:
            print(f"FAIL: {phase}: {e}", flush=True)
            failed = True
        finally:
            ok, left = c.down()
            if not ok:
                print(f"FAIL: {phase}: scripts/cluster down failed or left processes {left}", flush=True)
                failed = True
                for pid in left:  # only pids of this run dir's nodes and supervisors
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
    print(f"{'FAIL' if failed else 'OK'} in {time.monotonic() - start:.1f} s", flush=True)
    if failed:
        print(f"logs kept in {work}")
        return 1
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
