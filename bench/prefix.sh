#!/usr/bin/env bash
# Prefix caching on a multi-turn chat workload (issue 21's): CONV conversations
# of TURNS turns, each turn resending the history (a SYSTEM_LEN-token system
# prompt, then USER_LEN new tokens and the server's OUT_LEN-token answer per
# turn; HISTORY=tokens, the default, sends token ids with the answers' own
# ids, HISTORY=text words that the server re-encodes, answers included), through the HTTP frontend of a fresh disaggregated cluster
# (config/local) and a fresh colocated one (config/colocated), each with
# prefix caching on and off (disagg.prefix-caching). Model: MODEL (default the
# 50M synthetic one, made once into build/bench/m50). Prints per run one line:
#   prefix SYSTEM caching=on|off: hit=H% ttft_p50_turns2+=X ms duration=D s req/s=R prefilled=P never_seen=N kv_sent=B MB
# where prefilled and kv_sent are the prefill and decode nodes' own counters
# (disagg_prefill_tokens_total over every node, disagg_kv_transfer_bytes_total
# of the prefill nodes). Then the shared-prefix workload (SP_GROUPS groups of
# PER_GROUP requests sharing a PREFIX_LEN-token prompt, SUFFIX_LEN tokens
# each of their own, at most CONCURRENCY in flight) on the disaggregated
# cluster: per decode node its requests (prompt tokens looked up / prompt
# length) and the share of them that found their group's prefix there.
# Run by `scripts/bench prefix`; PARTS="multi-turn shared-prefix" (default)
# chooses.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
CONV=${CONV:-16} TURNS=${TURNS:-8} SYSTEM_LEN=${SYSTEM_LEN:-1024} USER_LEN=${USER_LEN:-64} OUT_LEN=${OUT_LEN:-64}
HISTORY=${HISTORY:-tokens}  # disagg-bench --history: token ids (the issue's workload) or text (a chat client's)
MODEL=${MODEL:-build/bench/m50/model.bin}
if [ ! -f "$MODEL" ]; then BIN_DIR=build/bin bench/make-m50.sh "$(dirname "$MODEL")"; fi
MODEL=$(cd "$(dirname "$MODEL")" && pwd)/$(basename "$MODEL")
TOKENIZER=${TOKENIZER:-$(dirname "$MODEL")/tokenizer.bin}
out=build/bench/prefix-$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$out"
running=""
trap 'if [ -n "$running" ]; then DISAGG_RUN_DIR=$running scripts/cluster down >/dev/null; fi' EXIT

counter() {  # PORTS NAME: the sum of a counter over the nodes' metrics ports
  local sum=0 port v
  for port in $1; do
    v=$(curl -s "http://127.0.0.1:$port/metrics" | awk -v n="$2" '$1 == n {print $2}')
    sum=$(python3 -c "print($sum + ${v:-0})")
  done
  echo "$sum"
}

run() {  # SYSTEM CONFIG_DIR CACHING
  local system=$1 config=$2 caching=$3 log=$out/$1-$3.log
  export DISAGG_RUN_DIR=$PWD/$out/run-$1-$3
  running=$DISAGG_RUN_DIR
  # (a copy of the configs with the setting: CAF 0.17 takes a bool on the
  # command line only as a flag that sets it)
  local configs=$out/config-$1-$3
  mkdir -p "$configs"
  for ini in "$config"/*.ini; do
    sed "s/^\[disagg\]\$/[disagg]\nprefix-caching = $caching/" "$ini" >"$configs/$(basename "$ini")"
  done
  MODEL=$MODEL TOKENIZER=$TOKENIZER scripts/cluster up "$configs" >"$out/up-$1-$3.log"
  local http ports
  http=$(sed -n 's/^http=//p' "$out/up-$1-$3.log" | head -n 1)
  ports=$(grep -ho 'metrics-port *= *[0-9]*' "$configs"/*.ini | grep -o '[0-9]*$' | tr '\n' ' ')
  bench/disagg-bench --base-url "http://$http" --workload multi-turn --conversations "$CONV" --turns "$TURNS" \
    --system-len "$SYSTEM_LEN" --user-len "$USER_LEN" --output-len "$OUT_LEN" --history "$HISTORY" \
    --vocab-size "${VOCAB_SIZE:-4096}" --seed 1 --timeout 1200 \
    --result-file "$out/$1-$3.json" >"$log" 2>&1 || { tail -n 20 "$log" >&2; exit 1; }
  local prefilled sent
  prefilled=$(counter "$ports" disagg_prefill_tokens_total)
  sent=$(counter "$ports" disagg_kv_transfer_bytes_total)
  python3 - "$out/$1-$3.json" "$system" "$caching" "$prefilled" "$sent" <<PY | tee -a "$out/summary.txt"
import json, sys
# (token history: the tokens no earlier request of a conversation sent: its
# system prompt and each turn's user tokens)
never_seen = $CONV * ($SYSTEM_LEN + $TURNS * $USER_LEN) if "$HISTORY" == "tokens" else None
r = json.load(open(sys.argv[1]))["results"][0]
print(f"prefix {sys.argv[2]} caching={'on' if sys.argv[3] == 'true' else 'off'}: hit={100 * r['prefix_hit_rate']:.1f}% "
      f"ttft_p50_turns2+={r['median_ttft_later_turns_ms']:.1f} ms duration={r['duration']:.1f} s "
      f"req/s={r['request_throughput']:.3f} completed={r['completed']} failed={r['failed']} "
      f"prompt_tokens={r['total_input_tokens']} prefilled={float(sys.argv[4]):.0f} "
      f"never_seen={never_seen if never_seen is not None else '-'} "
      f"kv_sent={float(sys.argv[5]) / 1e6:.1f} MB")
PY
  scripts/cluster down >/dev/null
  running=""
}

shared() {
  local system=disaggregated config=config/local configs=$out/config-shared log=$out/shared-prefix.log
  local groups=${SP_GROUPS:-4} per_group=${PER_GROUP:-16} prefix_len=${PREFIX_LEN:-1536} suffix_len=${SUFFIX_LEN:-128}
  export DISAGG_RUN_DIR=$PWD/$out/run-shared
  running=$DISAGG_RUN_DIR
  mkdir -p "$configs" && cp "$config"/*.ini "$configs"/
  MODEL=$MODEL TOKENIZER=$TOKENIZER scripts/cluster up "$configs" >"$out/up-shared.log"
  local http
  http=$(sed -n 's/^http=//p' "$out/up-shared.log" | head -n 1)
  bench/disagg-bench --base-url "http://$http" --workload shared-prefix --groups "$groups" \
    --num-prompts $((groups * per_group)) --prefix-len "$prefix_len" --input-len "$suffix_len" --output-len 16 \
    --max-concurrency "${CONCURRENCY:-4}" --vocab-size 4096 --seed 1 --timeout 1200 \
    --result-file "$out/shared-prefix.json" >"$log" 2>&1 || { tail -n 20 "$log" >&2; exit 1; }
  local ini port name
  for ini in "$configs"/decode-*.ini; do
    port=$(grep -o 'metrics-port *= *[0-9]*' "$ini" | grep -o '[0-9]*$')
    name=$(basename "$ini" .ini)
    curl -s "http://127.0.0.1:$port/metrics" | awk -v node="$name" -v p=$((prefix_len + suffix_len)) \
      -v g=$((prefix_len / 16 * 16)) '
      $1 == "disagg_prefix_cache_queries_total{role=\"decode\"}" {q = $2}
      $1 == "disagg_prefix_cache_hits_total{role=\"decode\"}" {h = $2}
      END {printf "shared-prefix %s: requests=%d found_their_prefix=%d\n", node, q / p, h / g}'
  done | tee -a "$out/summary.txt"
  python3 -c "import json; r = json.load(open('$out/shared-prefix.json'))['results'][0]; \
print(f\"shared-prefix: completed={r['completed']} failed={r['failed']} hit={100 * r['prefix_hit_rate']:.1f}%\")" |
    tee -a "$out/summary.txt"
  scripts/cluster down >/dev/null
  running=""
}

PARTS=${PARTS:-multi-turn shared-prefix}
[[ " $PARTS " == *" shared-prefix "* ]] && [[ " $PARTS " != *" multi-turn "* ]] && { shared; exit 0; }
echo "prefix: $CONV conversations x $TURNS turns, system $SYSTEM_LEN, $USER_LEN user and $OUT_LEN answer" \
  "tokens per turn (history as $HISTORY); model $MODEL; results in $out"
for system in disaggregated colocated; do
  config=config/local
  [ $system = colocated ] && config=config/colocated
  for caching in true false; do run $system $config $caching; done
done
if [[ " $PARTS " == *" shared-prefix "* ]]; then shared; fi
