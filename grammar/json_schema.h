// A JSON Schema compiled into a grammar (grammar/grammar.h) whose every
// sentence is a JSON text that validates against the schema: what
// response_format {"type": "json_schema"} and a tool's parameters generate
// under.
//
// Supported (README "Structured output" lists the same):
//   type (the seven, and lists of them); enum; const; anyOf; oneOf (its
//     branches of different types, or objects told apart by a required
//     const/enum property: anything else may overlap and is refused); allOf of object schemas without
//     additionalProperties (merged);
//     $ref to "#", "#/$defs/..." or "#/definitions/..." (recursion too);
//   objects: properties (written in the schema's order, as OpenAI's
//     structured outputs write them: an ordered_json keeps it; a
//     nlohmann::json holds them by name), required, additionalProperties (false, true or a schema;
//     absent counts as false where properties are named: only they are
//     written, which validates either way; an object schema naming none
//     allows any members);
//   arrays: items (a schema or false), prefixItems, minItems, maxItems;
//   strings: minLength, maxLength (characters), format date, time,
//     date-time, uuid, email; pattern (grammar/regex.h, ECMAScript's
//     syntax where it is regular; not beside minLength, maxLength, format);
//   numbers and integers: minimum, maximum, exclusiveMinimum,
//     exclusiveMaximum (a bounded number is written as an integer, or with
//     a fraction where every fraction stays in range);
//   annotations, ignored: title, description, default, examples,
//     deprecated, readOnly, writeOnly, $schema, $id, $comment.
// Any other keyword is a SchemaError naming it and where it is (a JSON
// pointer), never silently ignored. `strict` (OpenAI's structured outputs):
// every object must list all its properties in required and set
// additionalProperties to false.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

#include "grammar/grammar.h"

namespace disagg::grammar {

// A schema this compiler cannot turn into a grammar: the message names the
// keyword and its place.
struct SchemaError : GrammarError {
  using GrammarError::GrammarError;
};

// The most items a bounded array, and characters a bounded string, may
// require or allow (past this, maxItems/maxLength are refused).
constexpr int kMaxBoundedRepeat = 1024;

Grammar json_schema_grammar(const nlohmann::ordered_json& schema, bool strict = false);
Grammar json_schema_grammar(const nlohmann::json& schema, bool strict = false);

}  // namespace disagg::grammar
