// JSON's grammar, in pieces a schema's grammar is built from, and the one
// OpenAI's response_format {"type": "json_object"} asks for.
//
// Whitespace between tokens (`space`) is llama.cpp's json_schema_to_grammar
// choice: none, one space, or a newline and up to 20 spaces or tabs of
// indentation; none before the text or after it. Strings are valid UTF-8,
// with JSON's escapes; numbers have at most 16 digits before the point, 16
// after it and 3 in the exponent (bounds that keep a model from writing
// digits forever; README "Structured output").
#pragma once
#include "grammar/grammar.h"

namespace disagg::grammar {

class JsonPieces {
 public:
  explicit JsonPieces(Grammar& g);
  Expr space() const { return Grammar::ref(space_); }
  Expr string() const { return Grammar::ref(string_); }
  Expr string_char() const { return Grammar::ref(char_); }  // one character of a string's body
  Expr integer() const { return Grammar::ref(integer_); }
  Expr number() const { return Grammar::ref(number_); }
  Expr boolean() const { return Grammar::alt({Grammar::literal("true"), Grammar::literal("false")}); }
  Expr null() const { return Grammar::literal("null"); }
  Expr value() const { return Grammar::ref(value_); }    // any JSON value
  Expr object() const { return Grammar::ref(object_); }  // any JSON object
  Expr array() const { return Grammar::ref(array_); }    // any JSON array
  // `"key": value` with `space` where JSON allows it; the key as JSON writes it.
  Expr member(const Expr& key, const Expr& value) const;

 private:
  Grammar& g_;
  int space_, char_, string_, integer_, number_, value_, object_, array_;
};

// Any JSON object: response_format {"type": "json_object"}.
Grammar json_object_grammar();

}  // namespace disagg::grammar
