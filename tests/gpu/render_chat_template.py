#!/usr/bin/env python3
"""The reference for tests/gpu/test_chat_template.cpp: renders a chat template
as Hugging Face's apply_chat_template does (jinja2, trim_blocks and
lstrip_blocks, raise_exception, add_generation_prompt=True).
    render_chat_template.py IN.json OUT.json
IN: {"template": str, "bos_token": str, "eos_token": str, "today": str, "enable_thinking": bool (optional,
chat_template_kwargs' as Hugging Face passes them), "conversations": [[{role, content}...]...]}; a
conversation may also be {"messages": [...], "tools": [...]} (tools as Hugging Face passes them).
(strftime_now, which Hugging Face provides, returns "today": the date is the test's.)
OUT: one {"text": str} or {"error": str} per conversation."""
import json
import sys

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(Exception):
    pass


def raise_exception(message):
    raise TemplateError(message)


def main():
    spec = json.load(open(sys.argv[1], encoding="utf-8"))
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: spec["today"]
    # Hugging Face's own tojson (not Jinja's HTML-safe one): json.dumps, non-ASCII kept.
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    template = env.from_string(spec["template"])
    out = []
    for messages in spec["conversations"]:
        try:
            kwargs = {"enable_thinking": spec["enable_thinking"]} if "enable_thinking" in spec else {}
            tools = None
            if isinstance(messages, dict):
                messages, tools = messages["messages"], messages.get("tools")
            out.append({"text": template.render(messages=messages, tools=tools, documents=None,
                                                bos_token=spec["bos_token"], eos_token=spec["eos_token"],
                                                add_generation_prompt=True, **kwargs)})
        except (TemplateError, jinja2.TemplateError) as e:
            out.append({"error": str(e)})
    json.dump(out, open(sys.argv[2], "w", encoding="utf-8"))


if __name__ == "__main__":
    main()
