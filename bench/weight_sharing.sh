#!/usr/bin/env bash
# One copy of the weights per host (issue 43, item 3): config/local (router,
# 2 prefill, 2 decode, frontend) on MODEL with a weight cache (the config's
# weight-cache = "model", or CACHE_DIR), started three times in a row:
#   cold   no cache file (nor fingerprint memo) yet: the first worker builds it, the others map it
#   warm   the cache there: every worker maps it (a restart)
#   off    WITH_OFF=1 only: --disagg.weight-cache=off, each worker its own copy
#          (4 copies of the weights: leave it out where they do not fit)
# Each start: seconds from `scripts/cluster up` to every worker registered and
# the frontend's /health 200, then one request of 8 tokens served; the sum
# over the nodes of RSS and PSS (/proc/PID/smaps_rollup), against the model
# file plus the decode nodes' KV pools as configured (pool-blocks x
# block-size positions; touched only as used, so RSS counts less of them).
#
#   MODEL=path/8b.gguf bench/weight_sharing.sh     (run by `scripts/bench weights`)
#
# Prints one line per start:
#   weights START: serve_s=S rss_gb=R pss_gb=P file_gb=F pools_gb=K pss_over_file=Y pss_over_file_plus_pools=X
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
BIN=build/bin
[ -n "${MODEL:-}" ] || { echo "weight_sharing: MODEL=file.gguf is required" >&2; exit 2; }
MODEL=$(cd "$(dirname "$MODEL")" && pwd)/$(basename "$MODEL")
RUN_DIR=$(mktemp -d /tmp/disagg-weights-XXXXXX)
export DISAGG_RUN_DIR=$RUN_DIR MODEL
export CLUSTER_TIMEOUT=${CLUSTER_TIMEOUT:-300}
CACHE_OPTION=()
[ -n "${CACHE_DIR:-}" ] && CACHE_OPTION=("--disagg.weight-cache=$CACHE_DIR")

cleanup() {
  scripts/cluster down >/dev/null 2>&1 || true
  rm -rf "$RUN_DIR"
}
trap cleanup EXIT

# The decode pools as config/local sizes them, for MODEL's shape.
pools_bytes() {
  local blocks=0 block ini
  for ini in config/local/decode-*.ini; do
    blocks=$((blocks + $(sed -n 's/^pool-blocks *= *\([0-9]*\).*/\1/p' "$ini")))
    block=$(sed -n 's/^block-size *= *\([0-9]*\).*/\1/p' "$ini")
  done
  python3 - "$MODEL" "$blocks" "$block" <<'EOF'
import struct, sys
# Layers and KV width from the GGUF header (block_count, head_count_kv, embedding_length, head_count).
path, blocks, block = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with open(path, "rb") as f:
    data = f.read(64 << 20)  # the header: metadata (a vocabulary of 128k: ~3 MB) comes first
assert data[:4] == b"GGUF", "weight_sharing: MODEL must be a GGUF file"
n_kv = struct.unpack_from("<Q", data, 16)[0]
at, kv = 24, {}
sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
def value(t, at):
    if t == 8:
        n = struct.unpack_from("<Q", data, at)[0]
        return data[at + 8:at + 8 + n].decode(), at + 8 + n
    if t == 9:
        et, n = struct.unpack_from("<IQ", data, at)
        at += 12
        for _ in range(n):
            _, at = value(et, at)
        return None, at
    fmt = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}[t]
    return struct.unpack_from("<" + fmt, data, at)[0], at + sizes[t]
for _ in range(n_kv):
    n = struct.unpack_from("<Q", data, at)[0]
    key = data[at + 8:at + 8 + n].decode()
    t = struct.unpack_from("<I", data, at + 8 + n)[0]
    v, at = value(t, at + 12 + n)
    kv[key.split(".")[-1]] = v
kv_dim = kv["embedding_length"] // kv["head_count"] * kv["head_count_kv"]
print(blocks * block * kv["block_count"] * 2 * kv_dim * 4)
EOF
}

start() {  # NAME [OPTIONS...]
  local name=$1 began ended address rss=0 pss=0 pid f
  shift
  local options="${*:-${CACHE_OPTION[*]:-}}"
  began=$(date +%s.%N)
  DISAGG_OPTIONS="$options" scripts/cluster up >"$RUN_DIR/up.out"
  ended=$(date +%s.%N)
  address=$(cat "$RUN_DIR/router.address")
  "$BIN/disagg-client" --router "$address" --prompt-tokens "1 450 451 452" --max-new-tokens 8 --json >/dev/null 2>&1
  for f in "$RUN_DIR"/*.pid; do
    pid=$(cat "$f")
    [ -r "/proc/$pid/smaps_rollup" ] || continue
    rss=$((rss + $(awk '/^Rss:/ {print $2}' "/proc/$pid/smaps_rollup")))
    pss=$((pss + $(awk '/^Pss:/ {print $2}' "/proc/$pid/smaps_rollup")))
  done
  python3 - "$name" "$began" "$ended" "$rss" "$pss" "$(stat -c %s "$MODEL")" "$POOLS" <<'EOF'
import sys
name, began, ended, rss, pss, file, pools = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), *map(int, sys.argv[4:])
gb = 1e9
print(f"weights {name}: serve_s={ended - began:.2f} rss_gb={rss * 1024 / gb:.2f} pss_gb={pss * 1024 / gb:.2f} "
      f"file_gb={file / gb:.2f} pools_gb={pools / gb:.2f} pss_over_file={pss * 1024 / file:.3f} "
      f"pss_over_file_plus_pools={pss * 1024 / (file + pools):.3f}")
EOF
  grep -h "weight cache" "$RUN_DIR"/*.log | sed 's/^/  /' || true
  scripts/cluster down >/dev/null
}

POOLS=$(pools_bytes)
echo "weights: model $MODEL, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores"
if [ -n "${CACHE_DIR:-}" ]; then rm -rf "$CACHE_DIR"; else rm -f "$MODEL".*.wcache "$MODEL".*.wcache.lock "$MODEL".fingerprint; fi
start cold
start warm
if [ "${WITH_OFF:-0}" = 1 ]; then start off --disagg.weight-cache=off; fi
