#!/usr/bin/env bash
# Time to first token of long prompts on a multi-process cluster (1 router, 1
# prefill, 1 decode node on 127.0.0.1), for each way the KV can travel
# (kv-transport shm = UCX stream over shared memory, tcp = UCX stream over
# TCP, message = one CAF message after the prefill). Issue 8, item 5.
#
#   bench/ttft.sh [PROMPT_LENGTHS...]     (default 256 1024 1900; run by `scripts/bench ttft`)
#
# The model is the 50M synthetic one of the compute issue (made once into
# build/bench/m50/model.bin), or MODEL=path. Per prompt length and transport: one
# warm-up request, then RUNS (5) requests of one new token; medians of what
# disagg-client reports. Prints one line each:
#   ttft PROMPT transport=T: ttft=X ms prefill=Y ms kv_after_last_layer=Z ms share=Z/X kv=B MB
# where prefill ends with the last layer computed, and kv_after_last_layer is
# what the transfer adds after it (for message: all of the transfer).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
BIN=build/bin
RUNS=${RUNS:-5}
LENGTHS=("$@")
[ ${#LENGTHS[@]} -gt 0 ] || LENGTHS=(256 1024 1900)
OUT=build/bench/ttft
mkdir -p "$OUT"

MODEL=${MODEL:-build/bench/m50/model.bin}
if [ ! -f "$MODEL" ]; then
  BIN_DIR=$BIN bench/make-m50.sh "$(dirname "$MODEL")"
fi
MODEL=$(cd "$(dirname "$MODEL")" && pwd)/$(basename "$MODEL")

write_configs() {  # DIR TRANSPORT
  local dir=$1 transport=$2 router_port decode_port
  { read -r router_port; read -r decode_port; } < <(python3 tests/support/ports.py 2)
  rm -rf "$dir" && mkdir -p "$dir"
  cat >"$dir/router.ini" <<EOF
[node]
role = "router"
port = $router_port
[disagg]
model = "$MODEL"
EOF
  cat >"$dir/prefill.ini" <<EOF
[node]
role = "prefill"
name = "prefill-1"
router-port = $router_port
[disagg]
model = "$MODEL"
kv-transport = "$transport"
EOF
  cat >"$dir/decode.ini" <<EOF
[node]
role = "decode"
name = "decode-1"
port = $decode_port
router-port = $router_port
[disagg]
model = "$MODEL"
kv-transport = "$transport"
block-size = 16
pool-blocks = 256
EOF
}

median() { sort -n | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

for transport in shm tcp message; do
  dir=$OUT/$transport
  write_configs "$dir/config" "$transport"
  export DISAGG_RUN_DIR=$dir/run
  router=$(scripts/cluster up "$dir/config" | sed -n 's/^router=//p')
  trap 'DISAGG_RUN_DIR=$DISAGG_RUN_DIR scripts/cluster down >/dev/null 2>&1 || true' EXIT
  for n in "${LENGTHS[@]}"; do
    prompt=$(python3 -c "print(' '.join(['1'] + [str(3 + (i * 37) % 4000) for i in range(1, $n)]))")
    : >"$dir/runs-$n.txt"
    for run in $(seq 0 "$RUNS"); do
      # stderr: "ttft X ms, ... [prefill NAME P ms, kv transfer K ms, decode ...]"
      line=$("$BIN/disagg-client" --router "$router" --prompt-tokens "$prompt" --max-new-tokens 1 2>&1 >/dev/null |
             grep '^ttft')
      [ "$run" -eq 0 ] && continue  # warm-up
      echo "$line" | sed -E 's/^ttft ([0-9.]+) ms.*\[prefill [^ ]+ ([0-9.]+) ms, kv transfer ([0-9.]+) ms.*/\1 \2 \3/' \
        >>"$dir/runs-$n.txt"
    done
    ttft=$(cut -d' ' -f1 "$dir/runs-$n.txt" | median)
    prefill=$(cut -d' ' -f2 "$dir/runs-$n.txt" | median)
    kv=$(cut -d' ' -f3 "$dir/runs-$n.txt" | median)
    mb=$(python3 -c "print(round(2 * 16 * 512 * 4 * $n / 1e6, 1))")
    awk -v n="$n" -v t="$transport" -v a="$ttft" -v p="$prefill" -v k="$kv" -v mb="$mb" 'BEGIN {
      printf "ttft %d transport=%s: ttft=%.1f ms prefill=%.1f ms kv_after_last_layer=%.1f ms share=%.3f kv=%s MB\n",
             n, t, a, p, k, k / a, mb }'
  done
  scripts/cluster down >/dev/null
  trap - EXIT
done
