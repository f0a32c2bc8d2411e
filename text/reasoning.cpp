#include "text/reasoning.h"

namespace disagg::gpu {

namespace {

const std::string kOpen = "<think>";
const std::string kClose = "</think>";
const char* const kSpaces = " \n";

std::string without_leading_newlines(const std::string& s) {
  const size_t a = s.find_first_not_of('\n');
  return a == std::string::npos ? std::string() : s.substr(a);
}

// The length of the longest suffix of `s` that is a proper prefix of `tag`.
size_t partial_tag(const std::string& s, const std::string& tag) {
  for (size_t n = std::min(s.size(), tag.size() - 1); n > 0; --n)
    if (s.compare(s.size() - n, n, tag, 0, n) == 0) return n;
  return 0;
}

}  // namespace

ReasoningSyntax reasoning_syntax_of(const std::string& name) {
  return name == "qwen3" ? ReasoningSyntax::qwen3 : ReasoningSyntax::none;
}

bool prompt_opens_thought(ReasoningSyntax syntax, const std::string& tail) {
  if (syntax == ReasoningSyntax::none) return false;
  const size_t end = tail.find_last_not_of(kSpaces);
  return end != std::string::npos && end + 1 >= kOpen.size() && tail.compare(end + 1 - kOpen.size(), kOpen.size(), kOpen) == 0;
}

Reasoned split_reasoning(ReasoningSyntax syntax, const std::string& text, bool opened) {
  if (syntax == ReasoningSyntax::none) return {{}, text};
  size_t from = 0;
  if (!opened) {
    const size_t lead = text.find_first_not_of(kSpaces);
    if (lead == std::string::npos || text.compare(lead, kOpen.size(), kOpen) != 0) return {{}, text};
    from = lead + kOpen.size();
  }
  const size_t close = text.find(kClose, from);
  if (close == std::string::npos) return {text.substr(from), {}};
  return {text.substr(from, close - from), without_leading_newlines(text.substr(close + kClose.size()))};
}

Reasoned ReasoningStream::add(const std::string& piece) {
  if (syntax_ == ReasoningSyntax::none) return {{}, piece};
  pending_ += piece;
  Reasoned out;
  for (;;) {
    switch (phase_) {
      case Phase::start: {
        // (spaces and newlines, then what may be <think>, wait)
        // (from the first not seen before: a long run of them is read once)
        const size_t lead = pending_.find_first_not_of(kSpaces, spaces_);
        if (lead == std::string::npos) {
          spaces_ = pending_.size();
          return out;
        }
        const size_t rest = pending_.size() - lead;
        if (rest < kOpen.size() && kOpen.compare(0, rest, pending_, lead, rest) == 0) return out;
        if (pending_.compare(lead, kOpen.size(), kOpen) == 0) {
          pending_ = pending_.substr(lead + kOpen.size());
          phase_ = Phase::thinking;
        } else {
          phase_ = Phase::answer;
        }
        continue;
      }
      case Phase::thinking: {
        const size_t close = pending_.find(kClose);
        if (close != std::string::npos) {
          out.reasoning += pending_.substr(0, close);
          pending_ = pending_.substr(close + kClose.size());
          phase_ = Phase::answer_start;
          continue;
        }
        const size_t keep = partial_tag(pending_, kClose);
        out.reasoning += pending_.substr(0, pending_.size() - keep);
        pending_ = pending_.substr(pending_.size() - keep);
        return out;
      }
      case Phase::answer_start:
        pending_ = without_leading_newlines(pending_);
        if (pending_.empty()) return out;
        phase_ = Phase::answer;
        continue;
      case Phase::answer:
        out.content += pending_;
        pending_.clear();
        return out;
    }
  }
}

Reasoned ReasoningStream::flush() {
  Reasoned out;
  if (phase_ == Phase::thinking) out.reasoning = pending_;
  else if (phase_ != Phase::answer_start) out.content = pending_;
  pending_.clear();
  return out;
}

}  // namespace disagg::gpu
