// A model file's own chat template (tokenizer.chat_template) rendered by
// jinja2 itself: CPython embedded in the process (Debian's libpython3 and
// python3-jinja2), jinja2 set up as Hugging Face transformers'
// apply_chat_template sets it up:
//   - ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True),
//     with jinja2.ext.loopcontrols and the {% generation %} block (rendered
//     as its body);
//   - globals raise_exception(message) (a template's own refusal) and
//     strftime_now(format) (the local time now);
//   - the filter tojson(x, ensure_ascii=False, indent=None, separators=None,
//     sort_keys=False): json.dumps, not jinja2's HTML-safe one.
// The context is a JSON object whose keys become the template's variables
// (messages, tools, documents, add_generation_prompt, bos_token, eos_token
// and chat_template_kwargs' keys: the caller builds it).
//
// Bounds, because the template comes from a file and the context from a
// request: a compile or render stops with an error past `JinjaLimits::time`
// (its thread is interrupted between two Python steps, by an exception no
// `except Exception` takes, and again until it returns) or when its
// output passes `JinjaLimits::characters`; a repetition (`*`) that would
// make a string or list longer than that, and an integer power with an
// exponent over 4096, are refused before they run. Renders of one process
// take turns (Python's global lock); the interpreter starts at the first
// template and lives as long as the process.
#pragma once
#include <chrono>
#include <cstddef>
#include <string>

namespace disagg::gpu {

struct JinjaLimits {
  std::chrono::milliseconds time{1000};  // a chat template renders in well under a millisecond per message
  size_t characters = size_t(1) << 20;   // the caller's output bound (the frontend: from disagg.max-prompt-bytes)
};

class JinjaTemplate {
 public:
  // Compiles `source` within `limits` (jinja2 folds constant expressions
  // as it compiles, filters included); throws ChatTemplateError
  // (text/chat_template.h) with jinja2's message for a template it cannot
  // parse, the bound it passed, or when Python or jinja2 cannot be loaded.
  explicit JinjaTemplate(const std::string& source, const JinjaLimits& limits = {});
  ~JinjaTemplate();
  JinjaTemplate(const JinjaTemplate&) = delete;
  JinjaTemplate& operator=(const JinjaTemplate&) = delete;

  // The text `context_json` (a JSON object) renders to; throws
  // ChatTemplateError with raise_exception's or jinja2's message, or the
  // bound it passed. Safe from any thread.
  std::string render(const std::string& context_json, const JinjaLimits& limits = {}) const;

 private:
  void* compiled_;  // the jinja2.Template (a PyObject*), owned
};

}  // namespace disagg::gpu
