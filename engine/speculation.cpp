// Speculative decoding's proposer, gate and verification (engine/speculation.h).
#include "engine/speculation.h"

#include <algorithm>
#include <stdexcept>

#include "engine/stop_rule.h"

namespace disagg::gpu {

std::string to_string(SpeculationMethod method) {
  switch (method) {
    case SpeculationMethod::configured: return "configured";
    case SpeculationMethod::off: return "off";
    case SpeculationMethod::ngram: return "ngram";
    case SpeculationMethod::draft: return "draft";
  }
  return "unknown(" + std::to_string(int(method)) + ")";
}

bool parse_speculation_method(const std::string& text, SpeculationMethod& out) {
  if (text == "off") out = SpeculationMethod::off;
  else if (text == "ngram") out = SpeculationMethod::ngram;
  else if (text == "draft") out = SpeculationMethod::draft;
  else return false;
  return true;
}

std::string check_speculation(const SpeculationParams& p) {
  if (p.method != SpeculationMethod::configured && p.method != SpeculationMethod::off &&
      p.method != SpeculationMethod::ngram && p.method != SpeculationMethod::draft)
    return "speculation method " + std::to_string(int(p.method)) + " is not one of configured, off, ngram, draft";
  if (p.num_tokens < 0 || p.num_tokens > kMaxSpeculativeTokens)
    return "num_speculative_tokens must be in [1, " + std::to_string(kMaxSpeculativeTokens) + "] (got " +
           std::to_string(p.num_tokens) + ")";
  if (p.lookup_max < 0 || p.lookup_max > kMaxLookupTokens)
    return "prompt_lookup_max must be in [1, " + std::to_string(kMaxLookupTokens) + "] (got " +
           std::to_string(p.lookup_max) + ")";
  if (p.lookup_min < 0 || p.lookup_min > kMaxLookupTokens)
    return "prompt_lookup_min must be in [1, " + std::to_string(kMaxLookupTokens) + "] (got " +
           std::to_string(p.lookup_min) + ")";
  if (p.lookup_min > 0 && p.lookup_max > 0 && p.lookup_min > p.lookup_max)
    return "prompt_lookup_min (" + std::to_string(p.lookup_min) + ") exceeds prompt_lookup_max (" +
           std::to_string(p.lookup_max) + ")";
  return {};
}

SpeculationParams resolve_speculation(const SpeculationParams& request, const SpeculationParams& configured) {
  SpeculationParams r = configured;
  if (request.method != SpeculationMethod::configured) r.method = request.method;
  if (request.num_tokens > 0) r.num_tokens = request.num_tokens;
  if (request.lookup_max > 0) r.lookup_max = request.lookup_max;
  if (request.lookup_min > 0) r.lookup_min = request.lookup_min;
  r.lookup_min = std::min(r.lookup_min, r.lookup_max);
  return r;
}

std::vector<int> propose_ngram(const std::vector<int>& tokens, int lookup_min, int lookup_max, int max) {
  const int len = int(tokens.size());
  if (max <= 0 || lookup_min <= 0) return {};
  for (int n = std::min(lookup_max, len - 1); n >= lookup_min; --n) {
    const int* suffix = tokens.data() + (len - n);
    // Latest earlier start first: an occurrence ending before the suffix's own end.
    for (int start = len - n - 1; start >= 0; --start) {
      if (!std::equal(suffix, suffix + n, tokens.data() + start)) continue;
      const int from = start + n;
      const int count = std::min(max, len - from);
      return std::vector<int>(tokens.begin() + from, tokens.begin() + from + count);
    }
  }
  return {};
}

Proposer ngram_proposer(const SpeculationParams& p) {
  return [min = p.lookup_min, max_n = p.lookup_max](const std::vector<int>& tokens, int max) {
    return propose_ngram(tokens, min, max_n, max);
  };
}

Proposer oracle_proposer(std::vector<int> plain, size_t prompt_len) {
  return [plain = std::move(plain), prompt_len](const std::vector<int>& tokens, int max) {
    std::vector<int> out;
    for (size_t i = tokens.size() - prompt_len; i < plain.size() && int(out.size()) < max; ++i) out.push_back(plain[i]);
    return out;
  };
}

Proposer wrong_proposer(std::vector<int> plain, size_t prompt_len, int vocab) {
  return [plain = std::move(plain), prompt_len, vocab](const std::vector<int>& tokens, int max) {
    std::vector<int> out;
    for (size_t i = tokens.size() - prompt_len; int(out.size()) < max; ++i)
      out.push_back(i < plain.size() ? (plain[i] + 1) % vocab : 0);
    return out;
  };
}

void GuessCost::record(int rows, double seconds) {
  w_ = kDecay * w_ + 1;
  x_ = kDecay * x_ + rows;
  y_ = kDecay * y_ + seconds;
  xx_ = kDecay * xx_ + double(rows) * rows;
  xy_ = kDecay * xy_ + rows * seconds;
}

double GuessCost::share(int rows) const {
  const double spread = w_ * xx_ - x_ * x_;  // w^2 x the variance of the rows
  if (rows <= 0) return 0;
  if (spread <= 1e-9 * w_ * w_) return kUnmeasured;  // (steps of one size: no slope)
  const double per_row = std::max(0.0, (w_ * xy_ - x_ * y_) / spread);
  const double fixed = std::max(0.0, (y_ - per_row * x_) / w_);
  const double step = fixed + per_row * rows;
  return step > 0 ? rows * per_row / step : 0;
}

int SpeculationGate::allowed(int k, double cost) {
  ++asked_;
  if (pause_ > 0) {
    --pause_;
    return 0;
  }
  int n = std::min(k, cap_);
  probe_ = false;
  cost_ = cost;
  if (cost > 0) {
    // Guess i pays while acceptance^i > cost.
    const double a = acceptance();
    int paying = 0;
    for (double all_right = a; paying < n && all_right > cost; all_right *= a) ++paying;
    probe_ = paying == 0;
    if (probe_ && debt_ > kProbeAllowance + kProbeShare * double(asked_)) return 0;  // over budget
    n = std::max(1, std::min(n, paying));
  }
  return n;
}

void SpeculationGate::pause() {
  pause_ = next_;
  next_ = std::min(2 * next_, kMaxPause);
}

void SpeculationGate::record(int proposed, int accepted) {
  if (proposed <= 0) return;
  proposed_ += proposed;
  accepted_ += accepted;
  if (probe_) debt_ = std::max(0.0, debt_ + cost_ * proposed - accepted);
  right_ = kMemory * right_ + accepted;
  wrong_ = kMemory * wrong_ + (accepted < proposed ? 1 : 0);
  cap_ = accepted == proposed ? std::min(kMaxSpeculativeTokens, 2 * std::max(cap_, proposed)) : accepted + 1;
  if (accepted == 0) {
    pause();
    return;
  }
  // A probe right, but not yet enough to make a guess pay: the same pause
  // again (measuring costs a guess row each time), not a longer one.
  if (probe_ && acceptance() <= cost_) {
    pause_ = std::max(1, next_ / 2);
    return;
  }
  next_ = 1;
}

std::vector<Sampled> verify_draft(const float* logits, int vocab, const std::vector<int>& draft,
                                  const SamplingParams& sampling, uint64_t step, std::vector<int>& history,
                                  const std::vector<int>& end_tokens, const MaskFor& mask_for) {
  std::vector<Sampled> made;
  const bool keep_history = sampling.uses_history();
  for (size_t i = 0; i <= draft.size(); ++i) {
    const uint64_t index = step + i;
    try {
      std::shared_ptr<const grammar::TokenMask> mask;
      if (!sampling.grammar.empty()) mask = mask_for(history, index);
      made.push_back(sample(logits + i * size_t(vocab), vocab, sampling, index, history, end_tokens, mask.get()));
    } catch (const std::runtime_error&) {
      // (a grammar that allows no token here, say) Plain decoding makes
      // the tokens before it, each in a step of its own, and fails here; so
      // do we: what was made stands, and the next step, from the same
      // history and logits, fails at its first row.
      if (i == 0) throw;
      return made;
    }
    const int token = made.back().token;
    if (keep_history) history.push_back(token);
    const bool ends = index >= uint64_t(sampling.stop.min_tokens) && ends_generation(end_tokens, sampling.stop, token);
    if (ends || i == draft.size() || token != draft[i]) break;
  }
  return made;
}

int accepted_of(const std::vector<int>& draft, const std::vector<Sampled>& made) {
  size_t n = 0;
  while (n < draft.size() && n < made.size() && made[n].token == draft[n]) ++n;
  return int(n);
}

}  // namespace disagg::gpu
