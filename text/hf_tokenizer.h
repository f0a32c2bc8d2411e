// A Hugging Face tokenizer (tokenizer.json and tokenizer_config.json of a
// model directory) as a Vocabulary: byte-level BPE models only (Llama 3,
// Qwen2, Qwen3), the pre-tokenizer recognised by its Split regex. What
// llama.cpp's converter writes into a GGUF from the same files.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

#include "text/tokenizer.h"

namespace disagg::gpu {

// `tokenizer_json` and, when not empty, `config_json`; the vocabulary padded
// with unused [PADn] pieces to `vocab_size` rows (0: as many as the file
// has). Throws Error naming the file and the key: not JSON, not a BPE model
// with a ByteLevel pre-tokenizer, an unknown split regex, an id at or beyond
// `vocab_size`, a bos/eos token that is not in the vocabulary.
// A Hugging Face JSON file (config.json, tokenizer.json, ...), opened without
// blocking (gpu/file_check.h); throws Error "<path>: cannot open: ...",
// "<path>: not a regular file (a FIFO)" or "<path>: not JSON: ...".
nlohmann::json read_json_file(const std::string& path);

// `template_jinja`, when not empty: the directory's chat_template.jinja,
// which takes the place of the config's chat_template (as in transformers;
// the config's "tool_use" one stays).
Vocabulary read_hf_tokenizer(const std::string& tokenizer_json, const std::string& config_json, int vocab_size,
                             const std::string& template_jinja = "");

}  // namespace disagg::gpu
