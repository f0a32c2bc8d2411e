// Draft-model proposals (engine/draft.h).
#include "engine/draft.h"

#include <algorithm>
#include <numeric>

#include "engine/generate.h"
#include "engine/sampling.h"

namespace disagg::gpu {

std::string check_draft(const ModelConfig& target, const ModelConfig& draft) {
  if (draft.vocab_size != target.vocab_size)
    return "the draft model's vocabulary has " + std::to_string(draft.vocab_size) + " tokens, the model's " +
           std::to_string(target.vocab_size);
  if (draft.end_tokens != target.end_tokens) return "the draft model's end tokens are not the model's";
  return {};
}

DraftSequence::DraftSequence(Engine& draft, KvPool& pool, std::vector<int> blocks, int catch_up)
    : engine_(&draft), pool_(&pool), blocks_(std::move(blocks)), catch_up_(std::max(1, catch_up)) {
  capacity_ = std::min(int(blocks_.size()) * pool.block_size(), draft.config().seq_len);
}

std::vector<int> DraftSequence::propose(const std::vector<int>& tokens, int max) {
  const int len = int(tokens.size());
  // Fed: tokens at positions [0, len), then guesses 1 .. max - 1 at len ...
  max = std::min(max, capacity_ - len + 1);
  if (len == 0 || max <= 0) return {};
  // What it fed before and still holds, less the last token (whose logits it needs).
  const size_t same = size_t(std::mismatch(fed_.begin(), fed_.end(), tokens.begin(), tokens.end()).first - fed_.begin());
  const int from = std::min(int(same), len - 1);
  if (len - from > catch_up_) {  // (far behind: a part now, the guesses at a later step)
    engine_->prefill_chunk(*pool_, std::vector<int>(tokens.begin() + from, tokens.begin() + from + catch_up_), from,
                           blocks_);
    fed_.assign(tokens.begin(), tokens.begin() + from + catch_up_);
    return {};
  }
  std::vector<float> logits = engine_->prefill_chunk(
      *pool_, std::vector<int>(tokens.begin() + from, tokens.end()), from, blocks_);
  fed_.assign(tokens.begin(), tokens.end());
  const int vocab = engine_->config().vocab_size;
  std::vector<int> out{argmax(logits.data(), vocab)};
  while (int(out.size()) < max) {
    const int pos = len + int(out.size()) - 1;
    logits = engine_->decode_step(*pool_, {DecodeSlot{out.back(), pos, &blocks_}});
    fed_.push_back(out.back());
    out.push_back(argmax(logits.data(), vocab));
  }
  return out;
}

Proposer draft_proposer(Engine& draft, int prompt_len, int max_new_tokens) {
  const int bs = kDefaultBlockSize;
  const int positions = kv_positions_needed(prompt_len, max_new_tokens, draft.config().seq_len);
  const int n = KvPool::blocks_for(std::max(1, positions), bs);
  auto pool = std::make_shared<KvPool>(draft.backend(), draft.kv_shape(draft.config().seq_len), bs, n);
  std::vector<int> blocks(static_cast<size_t>(n));
  std::iota(blocks.begin(), blocks.end(), 0);
  auto sequence = std::make_shared<DraftSequence>(draft, *pool, std::move(blocks));
  return [pool, sequence](const std::vector<int>& tokens, int max) { return sequence->propose(tokens, max); };
}

}  // namespace disagg::gpu
