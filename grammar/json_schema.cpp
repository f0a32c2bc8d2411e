#include "grammar/json_schema.h"

#include "grammar/regex.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "grammar/json_grammar.h"

namespace disagg::grammar {

namespace {

using json = nlohmann::ordered_json;  // (the properties' order is the output's)

const std::set<std::string> kAnnotations = {"title",    "description", "default",  "examples", "deprecated",
                                            "readOnly", "writeOnly",   "$schema",  "$id",      "$comment"};
const std::set<std::string> kKeywords = {
    "type",     "enum",     "const",     "anyOf",     "oneOf",     "allOf",      "$ref",    "$defs",
    "definitions", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
    "maxItems", "minLength", "maxLength", "format",    "minimum",   "maximum",    "exclusiveMinimum",
    "exclusiveMaximum", "pattern"};

// The largest magnitude a bounded number is written with: JSON's grammar
// writes at most 16 digits before the point (grammar/json_grammar.h).
constexpr int64_t kMaxMagnitude = 9999999999999999;
// The most $refs followed in a row to find what a schema stands for (a
// chain longer than this is taken for a cycle).
constexpr int kMaxRefHops = 32;

// A schema that only annotates (true, {}, or a title or description alone).
bool annotation_only(const nlohmann::ordered_json& s) {
  if (s.is_boolean()) return s.get<bool>();
  if (!s.is_object()) return false;
  for (const auto& [key, value] : s.items())
    if (!kAnnotations.count(key)) return false;
  return true;
}

class Compiler {
 public:
  Compiler(Grammar& g, const json& root, bool strict) : g_(g), json_(g), root_(root), strict_(strict) {}

  Expr compile(const json& s, const std::string& at) {
    // Schemas nest through properties, items and $refs (a chain of $refs to
    // new targets nests without bound in the schema's own depth).
    const NestingGuard<SchemaError> nested(depth_, kMaxNesting, [&] {
      return "the schema at " + where(at) + " is nested more than " + std::to_string(kMaxNesting) + " deep";
    });
    if (s.is_boolean()) {
      if (s.get<bool>()) return json_.value();
      throw SchemaError("schema " + where(at) + " is false: nothing validates against it");
    }
    if (!s.is_object()) throw SchemaError("schema " + where(at) + " is not an object or a boolean");
    for (const auto& [key, value] : s.items())
      if (!kKeywords.count(key) && !kAnnotations.count(key))
        throw SchemaError("JSON Schema keyword '" + key + "' at " + where(at + "/" + key) + " is not supported");
    if (s.contains("$ref")) return ref(s, at);
    if (s.contains("const") || s.contains("enum")) return literals(s, at);
    for (const char* key : {"anyOf", "oneOf"})
      if (s.contains(key)) {
        only_with(s, key, at);
        const json& branches = s[key];
        if (!branches.is_array() || branches.empty())
          throw SchemaError(std::string(key) + " at " + where(at) + " must be a non-empty array");
        if (std::string(key) == "oneOf" && !disjoint(branches, at))
          throw SchemaError("oneOf at " + where(at) +
                            ": its branches may overlap (a value valid for two fails oneOf); only branches of "
                            "different types, or objects told apart by a required const/enum property, are supported");
        std::vector<Expr> options;
        for (size_t i = 0; i < branches.size(); ++i)
          options.push_back(compile(branches[i], at + "/" + key + "/" + std::to_string(i)));
        return Grammar::alt(options);
      }
    if (s.contains("allOf")) return compile(merged_all_of(s, at), at);
    return typed(s, at);
  }

 private:
  static std::string where(const std::string& at) { return at.empty() ? "the root" : at; }

  // The JSON type of a value ("number" for integers too).
  static const char* type_of(const json& v) {
    return v.is_object() ? "object" : v.is_array() ? "array" : v.is_string() ? "string" : v.is_boolean() ? "boolean"
           : v.is_null() ? "null" : "number";
  }

  // The names a schema's `type` gives: one, or a non-empty list of them.
  static std::vector<std::string> type_names(const json& t, const std::string& at) {
    std::vector<std::string> types;
    if (t.is_string()) types.push_back(t.get<std::string>());
    else if (t.is_array() && !t.empty())
      for (const json& x : t) {
        if (!x.is_string()) throw SchemaError("type at " + where(at) + " must name types");
        types.push_back(x.get<std::string>());
      }
    else throw SchemaError("type at " + where(at) + " must be a type name or a list of them");
    return types;
  }

  // const or enum: the values written as they are, those of `type` (when it
  // is given) only; any other keyword beside them is refused (its rule is
  // not checked against the values).
  Expr literals(const json& s, const std::string& at) {
    const char* key = s.contains("const") ? "const" : "enum";
    for (const auto& [k, v] : s.items())
      if (k != "const" && k != "enum" && k != "type" && !kAnnotations.count(k) && k != "$defs" && k != "definitions")
        throw SchemaError("'" + k + "' beside '" + key + "' at " + where(at) + " is not supported");
    if (s.contains("const") && s.contains("enum"))
      throw SchemaError("'enum' beside 'const' at " + where(at) + " is not supported");
    const json values = s.contains("const") ? json::array({s["const"]}) : s["enum"];
    if (!values.is_array() || values.empty()) throw SchemaError("enum at " + where(at) + " must be a non-empty array");
    std::set<std::string> types;
    if (s.contains("type"))
      for (std::string& t : type_names(s["type"], at)) types.insert(std::move(t));
    auto of_type = [&](const json& v) {
      if (types.empty() || types.count(type_of(v))) return true;
      // (an integer is a number whose fraction is zero: 1.0 too)
      return v.is_number() && types.count("integer") && std::isfinite(v.get<double>()) &&
             v.get<double>() == std::floor(v.get<double>());
    };
    std::vector<Expr> options;
    for (const json& v : values)
      if (of_type(v)) options.push_back(literal_of(v));
    if (options.empty())
      throw SchemaError(std::string(key) + " at " + where(at) + ": no value is of the type the schema names");
    return Grammar::alt(options);
  }

  // A keyword that must stand alone (but for annotations and $defs).
  static void only_with(const json& s, const std::string& key, const std::string& at) {
    for (const auto& [k, v] : s.items())
      if (k != key && !kAnnotations.count(k) && k != "$defs" && k != "definitions")
        throw SchemaError("'" + k + "' beside '" + key + "' at " + where(at) + " is not supported");
  }

  // The JSON types a schema's values can have (a conservative superset).
  std::set<std::string> types_of(const json& s, const std::string& at, int depth = 0) {
    static const std::set<std::string> all = {"object", "array", "string", "number", "boolean", "null"};
    if (!s.is_object() || depth > kMaxRefHops) return all;
    if (s.contains("$ref")) return types_of(resolve(s, at), at, depth + 1);
    std::vector<json> values;
    if (s.contains("const")) values.push_back(s["const"]);
    if (s.contains("enum") && s["enum"].is_array()) values.insert(values.end(), s["enum"].begin(), s["enum"].end());
    if (!values.empty()) {
      std::set<std::string> out;
      for (const json& v : values)
        out.insert(type_of(v));
      return out;
    }
    if (!s.contains("type")) return all;
    std::set<std::string> out;
    const json& t = s["type"];
    for (const json& x : t.is_array() ? t : json::array({t}))
      if (x.is_string()) out.insert(x == "integer" ? "number" : x.get<std::string>());
    return out;
  }

  // A value's text such that two values JSON Schema holds equal (1 and 1.0,
  // 0 and -0.0, objects whose keys come in other orders) have the same one,
  // and two it holds apart (integers past 2^53 too) different ones.
  static std::string canonical_text(const json& v) {
    if (v.is_number_unsigned()) return std::to_string(v.get<uint64_t>());
    if (v.is_number_integer()) return std::to_string(v.get<int64_t>());
    if (v.is_number()) {
      const double d = v.get<double>();
      // (a float with an integer's value is that integer: 2^63 is past int64)
      if (std::trunc(d) == d && d >= -9223372036854775808.0 && d < 9223372036854775808.0)
        return std::to_string(int64_t(d));
      char text[32];
      std::snprintf(text, sizeof text, "%.17g", d);
      return text;
    }
    if (v.is_array()) {
      std::string out = "[";
      for (const json& e : v) out += canonical_text(e) + ",";
      return out + "]";
    }
    if (v.is_object()) {
      std::vector<std::string> members;
      for (const auto& [key, e] : v.items()) members.push_back(json(key).dump() + ":" + canonical_text(e));
      std::sort(members.begin(), members.end());
      std::string out = "{";
      for (const std::string& m : members) out += m + ",";
      return out + "}";
    }
    return v.dump(-1, ' ', false, json::error_handler_t::replace);
  }

  // The values a required property of an object schema is pinned to (its
  // const or enum), or none.
  std::optional<std::vector<json>> pinned(const json& s, const std::string& name, const std::string& at) {
    const json& o = s.is_object() && s.contains("$ref") ? resolve(s, at) : s;  // (no copies: called per property)
    if (!o.is_object() || !o.contains("properties") || !o["properties"].contains(name) || !o.contains("required")) return {};
    const json& req = o["required"];
    if (std::find(req.begin(), req.end(), json(name)) == req.end()) return {};
    const json* p = &o["properties"][name];
    if (p->is_object() && p->contains("$ref")) p = &resolve(*p, at);
    if (!p->is_object()) return {};
    if (p->contains("const")) return std::vector<json>{(*p)["const"]};
    if (p->contains("enum") && (*p)["enum"].is_array()) return std::vector<json>((*p)["enum"].begin(), (*p)["enum"].end());
    return {};
  }

  // Whether no value can be valid for two of the branches: their types do
  // not meet, or (objects) one required property takes different pinned
  // values in each.
  bool disjoint(const json& branches, const std::string& at) {
    std::vector<std::set<std::string>> types;
    for (const json& b : branches) types.push_back(types_of(b, at));
    bool by_type = true;
    for (size_t i = 0; i < types.size() && by_type; ++i)
      for (size_t j = i + 1; j < types.size() && by_type; ++j)
        for (const std::string& t : types[i])
          if (types[j].count(t)) by_type = false;
    if (by_type) return true;
    const json& first = branches[0].is_object() && branches[0].contains("$ref") ? resolve(branches[0], at) : branches[0];
    if (!first.is_object() || !first.contains("properties") || !first["properties"].is_object()) return false;
    for (const auto& [name, unused] : first["properties"].items()) {
      std::vector<std::vector<json>> values;
      for (const json& b : branches) {
        auto v = pinned(b, name, at);
        if (!v) break;
        values.push_back(*v);
      }
      if (values.size() != branches.size()) continue;
      // (each value once, by its canonical text: linear in the values)
      std::unordered_map<std::string, size_t> branch_of;
      bool apart = true;
      for (size_t i = 0; i < values.size() && apart; ++i)
        for (const json& v : values[i]) {
          const auto [seen, fresh] = branch_of.emplace(canonical_text(v), i);
          if (!fresh && seen->second != i) {
            apart = false;
            break;
          }
        }
      if (apart) return true;
    }
    return false;
  }

  Expr literal_of(const json& v) { return Grammar::literal(v.dump(-1, ' ', false, json::error_handler_t::strict)); }

  Expr ref(const json& s, const std::string& at) {
    only_with(s, "$ref", at);
    const json& r = s["$ref"];
    if (!r.is_string()) throw SchemaError("$ref at " + where(at) + " is not a string");
    const std::string target = r.get<std::string>();
    if (auto it = refs_.find(target); it != refs_.end()) return Grammar::ref(it->second);
    if (target.empty() || target[0] != '#')
      throw SchemaError("$ref \"" + target + "\" at " + where(at) + ": only references inside the schema (#...) are supported");
    const json* found = nullptr;
    try {
      const json::json_pointer pointer(target.substr(1));
      if (root_.contains(pointer)) found = &root_.at(pointer);
    } catch (const json::exception&) {
    }
    if (!found) throw SchemaError("$ref \"" + target + "\" at " + where(at) + " names nothing in the schema");
    const int rule = g_.declare();  // declared first: the target may refer back
    refs_[target] = rule;
    g_.define(rule, compile(*found, target.substr(1)));
    return Grammar::ref(rule);
  }

  // allOf of object schemas as one object schema: their properties and
  // required together (a part with additionalProperties is refused).
  json merged_all_of(const json& s, const std::string& at) {
    const json& parts = s["allOf"];
    if (!parts.is_array() || parts.empty()) throw SchemaError("allOf at " + where(at) + " must be a non-empty array");
    json merged = s;
    merged.erase("allOf");
    // The outer schema's additionalProperties limits its own properties
    // only: a part's that it does not name are additional to it (false:
    // refused by the schema, a schema: held to it as well), not merged.
    const bool outer_limits = s.contains("additionalProperties") && s["additionalProperties"] != true;
    if (merged.contains("type") && merged["type"] != "object")
      throw SchemaError("allOf at " + where(at) + ": only object schemas are supported");
    if (merged.contains("properties") && !merged["properties"].is_object())
      throw SchemaError("properties at " + where(at) + " must be an object");
    for (size_t i = 0; i < parts.size(); ++i) {
      json part = parts[i];
      const std::string part_at = at + "/allOf/" + std::to_string(i);
      for (int hops = 0; part.is_object() && part.contains("$ref"); ++hops) {
        if (hops == kMaxRefHops)
          throw SchemaError("allOf at " + where(part_at) + ": more than " + std::to_string(kMaxRefHops) +
                            " $refs in a row (a cycle?)");
        part = resolve(part, part_at);
      }
      if (!part.is_object()) throw SchemaError("allOf at " + where(at) + ": only object schemas are supported");
      for (const auto& [key, value] : part.items()) {
        if (kAnnotations.count(key)) continue;
        if (key == "type") {
          if (value != "object") throw SchemaError("allOf at " + where(at) + ": only object schemas are supported");
          merged["type"] = "object";
        } else if (key == "properties") {
          if (!value.is_object()) throw SchemaError("properties at " + where(part_at) + " must be an object");
          for (const auto& [name, schema] : value.items()) {
            if (outer_limits && !(s.contains("properties") && s["properties"].contains(name)))
              throw SchemaError("allOf at " + where(part_at) + ": property \"" + name +
                                "\" is additional to the schema around the allOf, whose additionalProperties "
                                "limits it (name it in that schema's properties)");
            json& have = merged["properties"][name];
            // Two schemas for one property must both hold: supported where
            // one of them only annotates (a description added beside a $ref).
            if (have.is_null() || annotation_only(have)) have = schema;
            else if (!annotation_only(schema))
              throw SchemaError("allOf at " + where(part_at) + ": property \"" + name +
                                "\" has a schema in two parts (only one may constrain it)");
          }
        } else if (key == "required") {
          if (!value.is_array()) throw SchemaError("required at " + where(part_at) + " must be an array");
          if (merged.contains("required") && !merged["required"].is_array())
            throw SchemaError("required at " + where(at) + " must be an array");
          for (const json& name : value) merged["required"].push_back(name);
        } else if (key == "additionalProperties") {
          // (it limits the part's own properties: with another part's, the
          // merged object would be another schema)
          if (value != true)
            throw SchemaError("allOf at " + where(part_at) + ": additionalProperties inside allOf is not supported");
        } else if (key != "$defs" && key != "definitions") {
          throw SchemaError("allOf at " + where(part_at) + ": '" + key + "' inside allOf is not supported");
        }
      }
    }
    return merged;
  }

  const json& resolve(const json& s, const std::string& at) {
    const json& r = s["$ref"];
    if (!r.is_string() || r.get<std::string>().empty() || r.get<std::string>()[0] != '#')
      throw SchemaError("$ref at " + where(at) + " is not a reference inside the schema");
    try {
      return root_.at(json::json_pointer(r.get<std::string>().substr(1)));
    } catch (const json::exception&) {
      throw SchemaError("$ref at " + where(at) + " names nothing in the schema");
    }
  }

  Expr typed(const json& s, const std::string& at) {
    std::vector<std::string> types;
    if (s.contains("type")) {
      types = type_names(s["type"], at);
    } else {
      // No type: the one its keywords imply, else any value.
      if (s.contains("properties") || s.contains("required") || s.contains("additionalProperties")) types = {"object"};
      else if (s.contains("items") || s.contains("prefixItems") || s.contains("minItems") || s.contains("maxItems"))
        types = {"array"};
      else if (s.contains("minLength") || s.contains("maxLength") || s.contains("format") || s.contains("pattern"))
        types = {"string"};
      else if (s.contains("minimum") || s.contains("maximum") || s.contains("exclusiveMinimum") ||
               s.contains("exclusiveMaximum"))
        types = {"number"};
      else return json_.value();
    }
    std::vector<Expr> options;
    for (const std::string& t : types) {
      if (t == "object") options.push_back(object(s, at));
      else if (t == "array") options.push_back(array(s, at));
      else if (t == "string") options.push_back(string(s, at));
      else if (t == "integer") options.push_back(number(s, at, true));
      else if (t == "number") options.push_back(number(s, at, false));
      else if (t == "boolean") options.push_back(json_.boolean());
      else if (t == "null") options.push_back(json_.null());
      else throw SchemaError("type \"" + t + "\" at " + where(at) + " is not a JSON Schema type");
    }
    return Grammar::alt(options);
  }

  // ---- objects

  Expr object(const json& s, const std::string& at) {
    std::vector<std::string> names;
    std::vector<Expr> members;
    std::set<std::string> required;
    if (s.contains("required")) {
      if (!s["required"].is_array()) throw SchemaError("required at " + where(at) + " must be an array");
      for (const json& r : s["required"]) {
        if (!r.is_string()) throw SchemaError("required at " + where(at) + " must name properties");
        required.insert(r.get<std::string>());
      }
    }
    if (s.contains("properties")) {
      if (!s["properties"].is_object()) throw SchemaError("properties at " + where(at) + " must be an object");
      for (const auto& [name, schema] : s["properties"].items()) {
        names.push_back(name);
        // (a rule: the member is named by every alternative that may come before it)
        members.push_back(Grammar::ref(g_.rule(json_.member(literal_of(json(name)), compile(schema, at + "/properties/" + name)))));
      }
    }
    for (const std::string& r : required)
      if (std::find(names.begin(), names.end(), r) == names.end())
        throw SchemaError("required property \"" + r + "\" at " + where(at) + " has no schema in properties");
    std::optional<Expr> extra;  // a member of another name
    if (s.contains("additionalProperties") && s["additionalProperties"] != false)
      extra = json_.member(key_other_than(names), compile(s["additionalProperties"], at + "/additionalProperties"));
    else if (!s.contains("additionalProperties") && names.empty() && !strict_)
      extra = json_.member(json_.string(), json_.value());  // {"type": "object"} alone: any object
    if (strict_) {
      if (!s.contains("additionalProperties") || s["additionalProperties"] != false)
        throw SchemaError("strict: the object at " + where(at) + " must set additionalProperties to false");
      if (required.size() != names.size())
        throw SchemaError("strict: the object at " + where(at) + " must list every property in required");
    }
    std::vector<char> needed;
    for (const std::string& n : names) needed.push_back(required.count(n) ? 1 : 0);
    const Expr comma = g_.seq({Grammar::literal(","), json_.space()});
    // first[i]: members from i on, none written yet; rest[i]: after one.
    // Member i, or (optional) none of it and on from i + 1: linear in the
    // properties (each listing every later member was quadratic).
    const size_t n = names.size();
    std::vector<int> first(n + 1), rest(n + 1);
    for (size_t i = 0; i <= n; ++i) first[i] = g_.declare(), rest[i] = g_.declare();
    if (extra) {
      const Expr more = g_.star(g_.seq({comma, *extra}));
      g_.define(first[n], Grammar::alt({g_.seq({*extra, more}), Grammar::empty()}));
      g_.define(rest[n], more);
    } else {
      g_.define(first[n], Grammar::empty());
      g_.define(rest[n], Grammar::empty());
    }
    for (size_t i = n; i-- > 0;) {
      std::vector<Expr> f{g_.seq({members[i], Grammar::ref(rest[i + 1])})};
      std::vector<Expr> r{g_.seq({comma, members[i], Grammar::ref(rest[i + 1])})};
      if (!needed[i]) {
        f.push_back(Grammar::ref(first[i + 1]));
        r.push_back(Grammar::ref(rest[i + 1]));
      }
      g_.define(first[i], Grammar::alt(f));
      g_.define(rest[i], Grammar::alt(r));
    }
    return g_.seq({Grammar::literal("{"), json_.space(), Grammar::ref(first[0]), Grammar::literal("}")});
  }

  // A JSON string key that is none of `names` (so an additional property
  // never repeats a named one): the names' prefix tree, left as soon as a
  // character differs; a name's last character may not close the string.
  Expr key_other_than(const std::vector<std::string>& names) {
    if (names.empty()) return json_.string();
    const Expr any_rest = g_.seq({g_.star(json_.string_char()), Grammar::literal("\"")});
    struct Node {
      std::map<uint8_t, size_t> kids;
      bool word = false;
      bool mid = false;  // inside a character or an escape: only the name's next byte may follow
    };
    std::vector<Node> trie(1);
    for (const std::string& n : names) {
      // A name as its key is written: the JSON string's body.
      const std::string dumped = json(n).dump();
      const std::string body = dumped.substr(1, dumped.size() - 2);
      size_t at = 0, left = 0;  // bytes left of the current character or escape
      for (size_t k = 0; k < body.size(); ++k) {
        const uint8_t c = uint8_t(body[k]);
        if (left == 0) {
          left = c == '\\' ? (body[k + 1] == 'u' ? 6 : 2) : c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
        }
        --left;
        auto it = trie[at].kids.find(c);
        if (it == trie[at].kids.end()) {
          trie.push_back({});
          it = trie[at].kids.emplace(c, trie.size() - 1).first;
        }
        at = it->second;
        trie[at].mid = left > 0;
      }
      trie[at].word = true;
    }
    std::vector<int> rules(trie.size());
    for (size_t i = 0; i < trie.size(); ++i) rules[i] = g_.declare();
    for (size_t i = 0; i < trie.size(); ++i) {
      std::vector<Expr> options;
      ByteSet taken;
      for (const auto& [c, child] : trie[i].kids) {
        options.push_back(g_.seq({Grammar::bytes(ByteSet::of(c)), Grammar::ref(rules[child])}));
        taken.add(c, c);
      }
      if (trie[i].mid) {
        g_.define(rules[i], Grammar::alt(options));
        continue;
      }
      // Any other first byte of a character leaves the tree (a name's
      // multi-byte character shares its first byte: kept in the tree).
      ByteSet leave = ByteSet().add(0x20, 0x21).add(0x23, 0x5B).add(0x5D, 0x7E).add(0xC2, 0xF4);
      for (int b = 0; b < 256; ++b)
        if (taken.has(uint8_t(b)) && leave.has(uint8_t(b))) leave = without(leave, uint8_t(b));
      // An escape leaves too, unless a name has one here (then only by the
      // tree): only one of a character JSON must escape (a quote, a
      // backslash, a control character), since one of any other (`\u0061`
      // is "a") would spell a named property's key otherwise.
      std::vector<Expr> other{utf8_from(leave)};
      if (!taken.has('\\')) {
        other.push_back(g_.seq({Grammar::literal("\\"), Grammar::bytes(ByteSet().add('"', '"').add('\\', '\\').add('b', 'b')
                                                             .add('f', 'f').add('n', 'n').add('r', 'r').add('t', 't'))}));
        other.push_back(g_.seq({Grammar::literal("\\u00"), Grammar::bytes(ByteSet().add('0', '1')),
                                Grammar::bytes(ByteSet().add('0', '9').add('a', 'f').add('A', 'F'))}));
      }
      const Expr escape_or_other = Grammar::alt(other);
      options.push_back(g_.seq({escape_or_other, any_rest}));
      if (!trie[i].word) options.push_back(Grammar::literal("\""));
      g_.define(rules[i], Grammar::alt(options));
    }
    return g_.seq({Grammar::literal("\""), Grammar::ref(rules[0])});
  }

  static ByteSet without(const ByteSet& s, uint8_t b) {
    ByteSet out;
    for (int x = 0; x < 256; ++x)
      if (s.has(uint8_t(x)) && x != b) out.add(uint8_t(x), uint8_t(x));
    return out;
  }

  // One whole character whose first byte is in `first` (ASCII ones, or the
  // lead byte of a valid UTF-8 sequence).
  Expr utf8_from(const ByteSet& first) {
    const Expr t = Grammar::bytes(ByteSet::range(0x80, 0xBF));
    std::vector<Expr> options;
    ByteSet ascii;
    for (int b = 0x20; b < 0x7F; ++b)
      if (first.has(uint8_t(b))) ascii.add(uint8_t(b), uint8_t(b));
    if (!ascii.empty()) options.push_back(Grammar::bytes(ascii));
    for (int b = 0xC2; b <= 0xF4; ++b) {
      if (!first.has(uint8_t(b))) continue;
      const Expr lead = Grammar::literal(std::string(1, char(b)));
      if (b <= 0xDF) options.push_back(g_.seq({lead, t}));
      else if (b == 0xE0) options.push_back(g_.seq({lead, Grammar::bytes(ByteSet::range(0xA0, 0xBF)), t}));
      else if (b == 0xED) options.push_back(g_.seq({lead, Grammar::bytes(ByteSet::range(0x80, 0x9F)), t}));
      else if (b <= 0xEF) options.push_back(g_.seq({lead, t, t}));
      else if (b == 0xF0) options.push_back(g_.seq({lead, Grammar::bytes(ByteSet::range(0x90, 0xBF)), t, t}));
      else if (b <= 0xF3) options.push_back(g_.seq({lead, t, t, t}));
      else options.push_back(g_.seq({lead, Grammar::bytes(ByteSet::range(0x80, 0x8F)), t, t}));
    }
    return Grammar::alt(options);
  }

  // ---- arrays

  Expr array(const json& s, const std::string& at) {
    const int min = bound(s, "minItems", at, 0);
    const int max = bound(s, "maxItems", at, -1);
    if (max >= 0 && max < min) throw SchemaError("maxItems below minItems at " + where(at));
    std::vector<Expr> prefix;
    if (s.contains("prefixItems")) {
      if (!s["prefixItems"].is_array()) throw SchemaError("prefixItems at " + where(at) + " must be an array");
      for (size_t i = 0; i < s["prefixItems"].size(); ++i)
        prefix.push_back(compile(s["prefixItems"][i], at + "/prefixItems/" + std::to_string(i)));
    }
    std::optional<Expr> item = json_.value();
    if (s.contains("items")) {
      if (s["items"] == false) item.reset();
      else item = compile(s["items"], at + "/items");
    }
    const Expr comma = g_.seq({Grammar::literal(","), json_.space()});
    // tail(k): the items from index k on, each after a comma; count in [min, max].
    const int n = int(prefix.size());
    if (!item && min > n) throw SchemaError("minItems " + std::to_string(min) + " at " + where(at) + " needs more items than prefixItems allows");
    auto element = [&](int k) { return g_.seq({k < n ? prefix[size_t(k)] : *item, json_.space()}); };
    // The items from index k on (the first without a comma before it), built
    // from the last prefix item back (a loop: prefixItems may be long).
    auto items_from = [&](int k, bool first) -> Expr {  // k >= n: the items after the prefix
      if ((max >= 0 && k >= max) || !item) return Grammar::empty();
      const Expr one = g_.seq({comma, element(k)});
      const int need = std::max(0, min - k), up_to = max < 0 ? -1 : max - k;
      if (first) {
        const Expr head = element(k);
        const Expr more = g_.repeat(one, std::max(0, need - 1), up_to < 0 ? -1 : up_to - 1);
        return need > 0 ? g_.seq({head, more}) : g_.optional(g_.seq({head, more}));
      }
      return g_.repeat(one, need, up_to);
    };
    Expr from = items_from(n, n == 0);
    for (int k = n - 1; k >= 0; --k) {
      if (max >= 0 && k >= max) {
        from = Grammar::empty();
        continue;
      }
      const Expr here = g_.seq({k == 0 ? Grammar::empty() : comma, element(k), from});
      from = k >= min ? g_.optional(here) : here;
    }
    return g_.seq({Grammar::literal("["), json_.space(), from, Grammar::literal("]")});
  }

  static int bound(const json& s, const char* key, const std::string& at, int fallback) {
    if (!s.contains(key)) return fallback;
    const json& v = s[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > int64_t(kMaxBoundedRepeat))
      throw SchemaError(std::string(key) + " at " + where(at) + " must be an integer in [0, " +
                        std::to_string(kMaxBoundedRepeat) + "]");
    return int(v.get<int64_t>());
  }

  // ---- strings

  Expr string(const json& s, const std::string& at) {
    if (s.contains("pattern")) {
      if (s.contains("minLength") || s.contains("maxLength") || s.contains("format"))
        throw SchemaError("pattern beside minLength/maxLength/format at " + where(at) + " is not supported");
      if (!s["pattern"].is_string()) throw SchemaError("pattern at " + where(at) + " must be a string");
      try {
        const Expr body = json_pattern_body(g_, s["pattern"].get<std::string>(), json_.string_char());
        return g_.seq({Grammar::literal("\""), body, Grammar::literal("\"")});
      } catch (const SchemaError&) {
        throw;
      } catch (const GrammarError& e) {
        throw SchemaError("pattern at " + where(at) + ": " + e.what());
      }
    }
    if (s.contains("format")) {
      if (s.contains("minLength") || s.contains("maxLength"))
        throw SchemaError("minLength/maxLength beside format at " + where(at) + " is not supported");
      return format(s["format"], at);
    }
    const int min = bound(s, "minLength", at, 0);
    const int max = bound(s, "maxLength", at, -1);
    if (max >= 0 && max < min) throw SchemaError("maxLength below minLength at " + where(at));
    if (min == 0 && max < 0) return json_.string();
    return g_.seq({Grammar::literal("\""), g_.repeat(json_.string_char(), min, max), Grammar::literal("\"")});
  }

  Expr digits(int n) { return g_.repeat(Grammar::bytes(ByteSet::range('0', '9')), n, n); }
  Expr two_digit_range(int lo, int hi) { return natural_range(lo, hi, 2); }

  Expr format(const json& f, const std::string& at) {
    if (!f.is_string()) throw SchemaError("format at " + where(at) + " must be a string");
    const std::string name = f.get<std::string>();
    const Expr q = Grammar::literal("\"");
    // Days that exist in every year: February has 28.
    const Expr month_day = Grammar::alt({
        g_.seq({Grammar::literal("02-"), two_digit_range(1, 28)}),
        g_.seq({Grammar::alt({Grammar::literal("04"), Grammar::literal("06"), Grammar::literal("09"), Grammar::literal("11")}),
                Grammar::literal("-"), two_digit_range(1, 30)}),
        g_.seq({Grammar::alt({Grammar::literal("01"), Grammar::literal("03"), Grammar::literal("05"), Grammar::literal("07"),
                              Grammar::literal("08"), Grammar::literal("10"), Grammar::literal("12")}),
                Grammar::literal("-"), two_digit_range(1, 31)}),
    });
    const Expr date = g_.seq({digits(4), Grammar::literal("-"), month_day});
    const Expr zone = Grammar::alt({Grammar::literal("Z"), g_.seq({Grammar::bytes(ByteSet().add('+', '+').add('-', '-')),
                                                                  two_digit_range(0, 23), Grammar::literal(":"),
                                                                  two_digit_range(0, 59)})});
    const Expr time = g_.seq({two_digit_range(0, 23), Grammar::literal(":"), two_digit_range(0, 59), Grammar::literal(":"),
                              two_digit_range(0, 59),
                              g_.optional(g_.seq({Grammar::literal("."), g_.repeat(Grammar::bytes(ByteSet::range('0', '9')), 1, 6)})),
                              zone});
    const Expr hex = Grammar::bytes(ByteSet().add('0', '9').add('a', 'f'));
    if (name == "date") return g_.seq({q, date, q});
    if (name == "time") return g_.seq({q, time, q});
    if (name == "date-time") return g_.seq({q, date, Grammar::literal("T"), time, q});
    if (name == "uuid") {
      auto h = [&](int n) { return g_.repeat(hex, n, n); };
      return g_.seq({q, h(8), Grammar::literal("-"), h(4), Grammar::literal("-"), h(4), Grammar::literal("-"), h(4),
                     Grammar::literal("-"), h(12), q});
    }
    if (name == "email") {
      const Expr atom = g_.repeat(Grammar::bytes(ByteSet().add('a', 'z').add('A', 'Z').add('0', '9').add('_', '_').add('+', '+').add('-', '-')), 1, 32);
      const Expr label = g_.repeat(Grammar::bytes(ByteSet().add('a', 'z').add('A', 'Z').add('0', '9')), 1, 20);
      return g_.seq({q, atom, g_.repeat(g_.seq({Grammar::literal("."), atom}), 0, 3), Grammar::literal("@"), label,
                     g_.repeat(g_.seq({Grammar::literal("."), label}), 1, 3), q});
    }
    throw SchemaError("format \"" + name + "\" at " + where(at) + " is not supported (date, time, date-time, uuid, email are)");
  }

  // ---- numbers

  // Naturals in [lo, hi] written with exactly `width` digits (leading zeros),
  // digit by digit.
  Expr fixed_range(const std::string& lo, const std::string& hi) {
    if (lo.empty()) return Grammar::empty();
    if (lo == hi) return Grammar::literal(lo);
    const char a = lo[0], b = hi[0];
    const std::string lo_rest = lo.substr(1), hi_rest = hi.substr(1);
    const int n = int(lo_rest.size());
    if (a == b) return g_.seq({Grammar::literal(std::string(1, a)), fixed_range(lo_rest, hi_rest)});
    // a then [lo_rest, 9..9], the digits between with anything, b then
    // [0..0, hi_rest]; an end whose rest is unbounded joins the middle, so
    // only the two edges recurse (the grammar grows linearly with the width).
    const bool lo_open = lo_rest == std::string(size_t(n), '0'), hi_open = hi_rest == std::string(size_t(n), '9');
    std::vector<Expr> options;
    if (!lo_open) options.push_back(g_.seq({Grammar::literal(std::string(1, a)), fixed_range(lo_rest, std::string(size_t(n), '9'))}));
    const char mid_lo = lo_open ? a : char(a + 1), mid_hi = hi_open ? b : char(b - 1);
    if (mid_lo <= mid_hi) options.push_back(g_.seq({Grammar::bytes(ByteSet::range(uint8_t(mid_lo), uint8_t(mid_hi))), digits(n)}));
    if (!hi_open) options.push_back(g_.seq({Grammar::literal(std::string(1, b)), fixed_range(std::string(size_t(n), '0'), hi_rest)}));
    return Grammar::alt(options);
  }

  static std::string padded(int64_t v, int width) {
    std::string s = std::to_string(v);
    return std::string(size_t(std::max(0, width - int(s.size()))), '0') + s;
  }

  Expr natural_range(int64_t lo, int64_t hi, int width) { return fixed_range(padded(lo, width), padded(hi, width)); }

  // Naturals in [lo, hi] as JSON writes them (no leading zeros).
  Expr natural_range(int64_t lo, int64_t hi) {
    std::vector<Expr> options;
    int64_t start = 1;
    for (int width = 1; width <= 16; ++width, start *= 10) {
      const int64_t first = width == 1 ? 0 : start, last = start * 10 - 1;
      const int64_t a = std::max(lo, first), b = std::min(hi, last);
      if (a <= b) options.push_back(natural_range(a, b, width));
    }
    return Grammar::alt(options);
  }

  // Integers in [lo, hi].
  Expr integer_range(int64_t lo, int64_t hi) {
    std::vector<Expr> options;
    if (hi >= 0) options.push_back(natural_range(std::max<int64_t>(lo, 0), hi));
    if (lo < 0) options.push_back(g_.seq({Grammar::literal("-"), natural_range(std::max<int64_t>(1, -hi), -lo)}));
    return Grammar::alt(options);
  }

  Expr number(const json& s, const std::string& at, bool integer) {
    auto read = [&](const char* key) -> std::optional<double> {
      if (!s.contains(key)) return std::nullopt;
      if (!s[key].is_number()) throw SchemaError(std::string(key) + " at " + where(at) + " must be a number");
      const double v = s[key].get<double>();
      if (!std::isfinite(v) || std::fabs(v) > double(kMaxMagnitude))
        throw SchemaError(std::string(key) + " at " + where(at) + " is out of the range this compiler writes");
      return v;
    };
    const auto min = read("minimum"), max = read("maximum"), xmin = read("exclusiveMinimum"), xmax = read("exclusiveMaximum");
    if (!min && !max && !xmin && !xmax) return integer ? json_.integer() : json_.number();
    // The integers in range, then (numbers) the fractions that stay in it.
    // (with both an inclusive and an exclusive bound on a side, the tighter holds)
    const double lower = std::max(min.value_or(-double(kMaxMagnitude)), xmin.value_or(-double(kMaxMagnitude)));
    const double upper = std::min(max.value_or(double(kMaxMagnitude)), xmax.value_or(double(kMaxMagnitude)));
    int64_t lo = -kMaxMagnitude, hi = kMaxMagnitude;
    if (min) lo = std::max(lo, int64_t(std::ceil(*min)));
    if (xmin) lo = std::max(lo, int64_t(std::floor(*xmin)) + 1);
    if (max) hi = std::min(hi, int64_t(std::floor(*max)));
    if (xmax) hi = std::min(hi, int64_t(std::ceil(*xmax)) - 1);
    std::vector<Expr> options;
    if (lo <= hi) options.push_back(integer_range(lo, hi));
    if (!integer) {
      // A fraction with a non-zero last digit: ip.f lies strictly inside
      // (ip, ip + 1), -k.f inside (-(k + 1), -k); inside the bounds when
      // those intervals are (for either kind of bound). As a double it may
      // round onto either integer beside it, which an exclusive bound there
      // refuses (1.0000000000000001 is 1.0): beside one, at most 15
      // significant digits in all (DBL_DIG: then it is neither).
      const bool lower_open = xmin && (!min || *xmin >= *min), upper_open = xmax && (!max || *xmax <= *max);
      auto digits_of = [](int64_t v) {
        int d = 0;
        for (; v > 0; v /= 10) ++d;
        return d;
      };
      // Integer parts [lo, hi], those at an edge beside an open bound written with fewer digits.
      auto fractions = [&](int64_t lo, int64_t hi, bool lo_edge, bool hi_edge, bool negative) {
        auto put = [&](int64_t a, int64_t b, int digits) {
          if (a > b || digits < 1) return;
          const Expr fraction = g_.seq({Grammar::literal("."), g_.repeat(Grammar::bytes(ByteSet::range('0', '9')), 0, digits - 1),
                                        Grammar::bytes(ByteSet::range('1', '9'))});
          const Expr e = g_.seq({natural_range(a, b), fraction});
          options.push_back(negative ? g_.seq({Grammar::literal("-"), e}) : e);
        };
        if (lo > hi) return;
        const int edge_digits = std::numeric_limits<double>::digits10;
        put(lo + (lo_edge ? 1 : 0), hi - (hi_edge ? 1 : 0), 16);
        if (lo_edge) put(lo, lo, edge_digits - digits_of(lo));
        if (hi_edge && (hi != lo || !lo_edge)) put(hi, hi, edge_digits - digits_of(hi));
      };
      const int64_t ip_lo = std::max<int64_t>(0, int64_t(std::ceil(lower))), ip_hi = int64_t(std::floor(upper)) - 1;
      fractions(ip_lo, ip_hi, lower_open && double(ip_lo) == lower, upper_open && double(ip_hi + 1) == upper, false);
      const int64_t k_lo = std::max<int64_t>(0, int64_t(std::ceil(-upper))), k_hi = int64_t(std::floor(-lower)) - 1;
      fractions(k_lo, k_hi, upper_open && -double(k_lo) == upper, lower_open && -double(k_hi + 1) == lower, true);
    }
    if (options.empty())
      throw SchemaError("no " + std::string(integer ? "integer" : "number") + " is in range at " + where(at));
    return Grammar::alt(options);
  }

  Grammar& g_;
  JsonPieces json_;
  const json& root_;
  bool strict_;
  int depth_ = 0;  // compile()'s calls in progress
  std::map<std::string, int> refs_;
};

}  // namespace

Grammar json_schema_grammar(const nlohmann::json& schema, bool strict) {
  return json_schema_grammar(nlohmann::ordered_json(schema), strict);
}

Grammar json_schema_grammar(const nlohmann::ordered_json& schema, bool strict) {
  Grammar g;
  Compiler c(g, schema, strict);
  g.define(0, c.compile(schema, ""));
  g.check();
  return g;
}

}  // namespace disagg::grammar
