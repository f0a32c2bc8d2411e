#include "text/chat_template.h"

#include "text/jinja.h"

#include <array>
#include <ctime>

#include <nlohmann/json.hpp>
#include <utility>

namespace disagg::gpu {
namespace {

constexpr std::array<std::pair<ChatTemplate, const char*>, 11> kNames{{
    {ChatTemplate::llama2, "llama2"},
    {ChatTemplate::llama3, "llama3"},
    {ChatTemplate::llama31, "llama3.1"},
    {ChatTemplate::llama32, "llama3.2"},
    {ChatTemplate::chatml, "chatml"},
    {ChatTemplate::qwen2, "qwen2"},
    {ChatTemplate::qwen25, "qwen2.5"},
    {ChatTemplate::qwen3, "qwen3"},
    {ChatTemplate::mistral, "mistral"},
    {ChatTemplate::gemma, "gemma"},
    {ChatTemplate::plain, "plain"},
}};

bool contains(const std::string& s, const char* what) { return s.find(what) != std::string::npos; }
bool starts_with(const std::string& s, const std::string& p) { return s.compare(0, p.size(), p) == 0; }
bool ends_with(const std::string& s, const std::string& p) {
  return s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
}

// Length of the Python whitespace character (str.isspace) at s[i], or 0:
// Jinja's `trim` and Python's strip() remove these.
size_t space_at(const std::string& s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  if (c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1C && c <= 0x1F)) return 1;
  auto is = [&](const char* seq) { return s.compare(i, std::char_traits<char>::length(seq), seq) == 0; };
  if (is("\xC2\x85") || is("\xC2\xA0")) return 2;  // U+0085, U+00A0
  if (is("\xE1\x9A\x80") || is("\xE3\x80\x80")) return 3;  // U+1680, U+3000
  if (c == 0xE2 && i + 2 < s.size()) {
    const auto c1 = static_cast<unsigned char>(s[i + 1]), c2 = static_cast<unsigned char>(s[i + 2]);
    if (c1 == 0x80 && (c2 <= 0x8A || c2 == 0xA8 || c2 == 0xA9 || c2 == 0xAF)) return 3;  // U+2000..200A, 2028, 2029, 202F
    if (c1 == 0x81 && c2 == 0x9F) return 3;                                                // U+205F
  }
  return 0;
}

// Python's str.strip() (Jinja's trim).
std::string strip(const std::string& s) {
  size_t a = 0;
  while (a < s.size()) {
    const size_t n = space_at(s, a);
    if (n == 0) break;
    a += n;
  }
  size_t b = s.size();
  while (b > a) {
    // Step back over one code point and test it.
    size_t start = b - 1;
    while (start > a && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
    if (space_at(s, start) != b - start) break;
    b = start;
  }
  return s.substr(a, b - a);
}

std::string lstrip_newlines(const std::string& s) { return s.substr(std::min(s.find_first_not_of('\n'), s.size())); }
std::string rstrip_newlines(const std::string& s) {
  const size_t last = s.find_last_not_of('\n');
  return last == std::string::npos ? std::string() : s.substr(0, last + 1);
}
std::string strip_newlines(const std::string& s) { return lstrip_newlines(rstrip_newlines(s)); }

class Pieces {
 public:
  void text(const std::string& s) {
    if (s.empty()) return;
    if (!out_.empty() && out_.back().kind == ChatPiece::text) out_.back().value += s;
    else out_.push_back({ChatPiece::text, s});
  }
  void bos() { out_.push_back({ChatPiece::bos, {}}); }
  void eos() { out_.push_back({ChatPiece::eos, {}}); }
  std::vector<ChatPiece> take() { return std::move(out_); }

 private:
  std::vector<ChatPiece> out_;
};

// The rule of the llama2/mistral/gemma templates: user at even positions,
// assistant at odd ones (counted from `first`).
void require_alternation(const std::vector<ChatMessage>& m, size_t first) {
  for (size_t i = first; i < m.size(); ++i)
    if ((m[i].role == "user") != ((i - first) % 2 == 0))
      throw ChatTemplateError{"Conversation roles must alternate user/assistant/user/assistant/... (message " +
                              std::to_string(i) + " is " + m[i].role + ")"};
}

void render_llama2(const std::vector<ChatMessage>& m, Pieces& out) {
  const bool system = !m.empty() && m[0].role == "system";
  const size_t first = system ? 1 : 0;
  require_alternation(m, first);
  for (size_t i = first; i < m.size(); ++i) {
    const std::string content =
        i == first && system ? "<<SYS>>\n" + m[0].content + "\n<</SYS>>\n\n" + m[i].content : m[i].content;
    if (m[i].role == "user") {
      out.bos();
      out.text("[INST] " + strip(content) + " [/INST]");
    } else if (m[i].role == "assistant") {
      out.text(" " + strip(content) + " ");
      out.eos();
    }
  }
}

// Llama 3.1-3.3 Instruct without tools: the system block is always there.
void render_llama31(const std::vector<ChatMessage>& m, const std::string& date, Pieces& out) {
  const bool system = !m.empty() && m[0].role == "system";
  out.bos();
  out.text("<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: " + date +
           "\n\n" + (system ? strip(m[0].content) : std::string()) + "<|eot_id|>");
  for (size_t i = system ? 1 : 0; i < m.size(); ++i) {
    if (m[i].role == "tool" || m[i].role == "ipython")  // a string is iterable to Jinja: tojson quotes it
      out.text("<|start_header_id|>ipython<|end_header_id|>\n\n" + nlohmann::json(m[i].content).dump() + "<|eot_id|>");
    else
      out.text("<|start_header_id|>" + m[i].role + "<|end_header_id|>\n\n" + strip(m[i].content) + "<|eot_id|>");
  }
  out.text("<|start_header_id|>assistant<|end_header_id|>\n\n");
}

// strftime("%d %b %Y") of now, local time (as Hugging Face's strftime_now).
std::string today_date() {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char buffer[32];
  std::strftime(buffer, sizeof buffer, "%d %b %Y", &local);
  return buffer;
}

// Qwen's tool results: consecutive tool messages in one user turn, each as
// <tool_response>.
void render_tool_response(const std::vector<ChatMessage>& m, size_t i, Pieces& out) {
  if (i == 0 || m[i - 1].role != "tool") out.text("<|im_start|>user");
  out.text("\n<tool_response>\n" + m[i].content + "\n</tool_response>");
  if (i + 1 == m.size() || m[i + 1].role != "tool") out.text("<|im_end|>\n");
}

void render_qwen3(const std::vector<ChatMessage>& m, Pieces& out) {
  if (!m.empty() && m[0].role == "system") out.text("<|im_start|>system\n" + m[0].content + "<|im_end|>\n");
  // The last user message that is not a tool response (else the last message).
  size_t last_query = m.empty() ? 0 : m.size() - 1;
  for (size_t k = m.size(); k-- > 0;)
    if (m[k].role == "user" && !(starts_with(m[k].content, "<tool_response>") && ends_with(m[k].content, "</tool_response>"))) {
      last_query = k;
      break;
    }
  for (size_t i = 0; i < m.size(); ++i) {
    const ChatMessage& msg = m[i];
    if (msg.role == "user" || (msg.role == "system" && i > 0)) {
      out.text("<|im_start|>" + msg.role + "\n" + msg.content + "<|im_end|>\n");
    } else if (msg.role == "assistant") {
      std::string content = msg.content, reasoning;
      if (const size_t end = msg.content.rfind("</think>"); end != std::string::npos) {
        content = lstrip_newlines(msg.content.substr(end + 8));
        const std::string before = rstrip_newlines(msg.content.substr(0, msg.content.find("</think>")));
        const size_t open = before.rfind("<think>");
        reasoning = lstrip_newlines(open == std::string::npos ? before : before.substr(open + 7));
      }
      const bool last = i + 1 == m.size();
      if (i > last_query && (last || !reasoning.empty()))
        out.text("<|im_start|>assistant\n<think>\n" + strip_newlines(reasoning) + "\n</think>\n\n" + lstrip_newlines(content));
      else
        out.text("<|im_start|>assistant\n" + content);
      out.text("<|im_end|>\n");
    } else if (msg.role == "tool") {
      render_tool_response(m, i, out);
    }
  }
  out.text("<|im_start|>assistant\n");
}

}  // namespace

std::optional<ChatTemplate> parse_chat_template(const std::string& name) {
  for (const auto& [t, n] : kNames)
    if (name == n) return t;
  return std::nullopt;
}

const char* to_string(ChatTemplate tmpl) {
  for (const auto& [t, n] : kNames)
    if (t == tmpl) return n;
  return "?";
}

std::string chat_template_names() {
  std::string out;
  for (const auto& [t, n] : kNames) out += (out.empty() ? "" : ", ") + std::string(n);
  return out;
}

std::optional<ChatTemplate> detect_chat_template(const std::string& j) {
  // ChatML variants by their default system messages (Qwen2, Qwen2.5).
  if (contains(j, "<|start_header_id|>") && contains(j, "<|end_header_id|>")) {
    if (!contains(j, "Cutting Knowledge Date")) return ChatTemplate::llama3;
    return contains(j, "strftime_now") ? ChatTemplate::llama32 : ChatTemplate::llama31;
  }
  if (contains(j, "<|im_start|>")) {
    if (contains(j, "<think>")) return ChatTemplate::qwen3;
    if (contains(j, "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.")) return ChatTemplate::qwen25;
    if (contains(j, "<|im_start|>system\\nYou are a helpful assistant.<|im_end|>") ||
        contains(j, "<|im_start|>system\nYou are a helpful assistant.<|im_end|>"))
      return ChatTemplate::qwen2;
    return ChatTemplate::chatml;
  }
  if (contains(j, "<start_of_turn>")) return ChatTemplate::gemma;
  if (contains(j, "[INST]")) return contains(j, "<<SYS>>") ? ChatTemplate::llama2 : ChatTemplate::mistral;
  return std::nullopt;
}

std::vector<ChatPiece> render_chat_pieces(ChatTemplate tmpl, const std::vector<ChatMessage>& m, const std::string& today,
                                          bool enable_thinking) {
  Pieces out;
  switch (tmpl) {
    case ChatTemplate::llama31:
      render_llama31(m, "26 Jul 2024", out);
      break;
    case ChatTemplate::llama32:
      render_llama31(m, today.empty() ? today_date() : today, out);
      break;
    case ChatTemplate::llama2:
      render_llama2(m, out);
      break;
    case ChatTemplate::llama3:
      out.bos();
      for (const ChatMessage& msg : m)
        out.text("<|start_header_id|>" + msg.role + "<|end_header_id|>\n\n" + strip(msg.content) + "<|eot_id|>");
      out.text("<|start_header_id|>assistant<|end_header_id|>\n\n");
      break;
    case ChatTemplate::chatml:
    case ChatTemplate::qwen2:
    case ChatTemplate::qwen25:
      if (tmpl != ChatTemplate::chatml && !m.empty() && m[0].role != "system")
        out.text(std::string("<|im_start|>system\n") +
                 (tmpl == ChatTemplate::qwen2 ? "You are a helpful assistant."
                                              : "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.") +
                 "<|im_end|>\n");
      for (size_t i = 0; i < m.size(); ++i) {
        if (tmpl == ChatTemplate::qwen25 && m[i].role == "tool") render_tool_response(m, i, out);
        else out.text("<|im_start|>" + m[i].role + "\n" + m[i].content + "<|im_end|>\n");
      }
      out.text("<|im_start|>assistant\n");
      break;
    case ChatTemplate::qwen3:
      render_qwen3(m, out);
      if (!enable_thinking) out.text("<think>\n\n</think>\n\n");
      break;
    case ChatTemplate::mistral:
      require_alternation(m, 0);
      out.bos();
      for (const ChatMessage& msg : m) {
        if (msg.role == "user") {
          out.text("[INST] " + msg.content + " [/INST]");
        } else if (msg.role != "assistant") {
          throw ChatTemplateError{"Only user and assistant roles are supported!"};
        } else {
          out.text(msg.content);
          out.eos();
        }
      }
      break;
    case ChatTemplate::gemma:
      if (!m.empty() && m[0].role == "system") throw ChatTemplateError{"System role not supported"};
      require_alternation(m, 0);
      out.bos();
      for (const ChatMessage& msg : m)
        out.text("<start_of_turn>" + std::string(msg.role == "assistant" ? "model" : msg.role) + "\n" + strip(msg.content) +
                 "<end_of_turn>\n");
      out.text("<start_of_turn>model\n");
      break;
    case ChatTemplate::plain: {
      std::string text;
      for (const ChatMessage& msg : m) text += msg.role + ": " + msg.content + "\n";
      out.bos();
      out.text(text + "assistant:");
      break;
    }
  }
  return out.take();
}

std::string chat_text(const std::vector<ChatPiece>& pieces, const std::string& bos, const std::string& eos) {
  std::string out;
  for (const ChatPiece& p : pieces) out += p.kind == ChatPiece::text ? p.value : p.kind == ChatPiece::bos ? bos : eos;
  return out;
}

ChatTemplate family_of_template(const std::string& jinja) {
  if (const auto builtin = detect_chat_template(jinja)) return *builtin;
  if (contains(jinja, "<|start_header_id|>")) return ChatTemplate::llama31;
  if (contains(jinja, "<|im_start|>")) return contains(jinja, "<think>") ? ChatTemplate::qwen3 : ChatTemplate::chatml;
  if (contains(jinja, "[INST]")) return contains(jinja, "[TOOL_CALLS]") ? ChatTemplate::mistral : ChatTemplate::llama2;
  if (contains(jinja, "<start_of_turn>")) return ChatTemplate::gemma;
  return ChatTemplate::plain;
}

ChosenTemplate choose_chat_template(const std::string& configured, const Vocabulary& vocabulary) {
  ChosenTemplate out;
  if (configured != "auto") {
    if (const auto named = parse_chat_template(configured)) {
      out.format = ChatFormat(*named);
      out.source = std::string("the built-in ") + to_string(*named) + " named by node.chat-template";
    } else {
      out.error = "no built-in chat template is called \"" + configured + "\" (" + chat_template_names() + ")";
    }
  } else if (!vocabulary.chat_template.empty()) {
    try {
      out.format = ChatFormat(family_of_template(vocabulary.chat_template));
      out.format.jinja = std::make_shared<const JinjaTemplate>(vocabulary.chat_template);
      out.source = std::string("the model file's, rendered by jinja2 (family ") + to_string(out.format.family) + ")";
      if (!vocabulary.tool_use_template.empty()) {
        out.format.tool_use = std::make_shared<const JinjaTemplate>(vocabulary.tool_use_template);
        out.source += ", and its tool_use template for requests with tools";
      }
    } catch (const ChatTemplateError& e) {
      out.error = "the model file's chat template: " + e.message + " (name a built-in with node.chat-template)";
    }
  } else {
    out.format = ChatFormat(vocabulary.model == TokenizerModel::sentencepiece ? ChatTemplate::llama2 : ChatTemplate::plain);
    out.source = std::string("the built-in ") + to_string(out.format.family) + ": the model file has none";
  }
  return out;
}

}  // namespace disagg::gpu
