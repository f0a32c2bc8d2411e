#!/usr/bin/env bash
# Writes the 50M synthetic model of the benchmarks ("m50": dim 512, hidden 1376,
# 16 layers, 8 heads, vocab 4096, context 2048; random weights, and a tokenizer
# of its vocabulary) into DIR as model.bin and tokenizer.bin, with
# disagg-make-model from BIN_DIR (default build/bin). One place for its shape:
# bench/ttft.sh and `scripts/bench compare` make it here.
#
#   bench/make-m50.sh DIR
set -euo pipefail
[ $# -eq 1 ] || { sed -n '2,8s/^# \{0,1\}//p' "$0" >&2; exit 2; }
"${BIN_DIR:-build/bin}/disagg-make-model" --out "$1" --dim 512 --hidden 1376 --layers 16 --heads 8 --kv-heads 8 \
  --vocab 4096 --seq-len 2048 >/dev/null
