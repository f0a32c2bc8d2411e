#include "grammar/json_grammar.h"

#include "grammar/code_points.h"

namespace disagg::grammar {

namespace {

ByteSet bytes(uint8_t lo, uint8_t hi) { return ByteSet::range(lo, hi); }

// One character that JSON writes unescaped in a string (plain_char_forms).
Expr utf8_char(Grammar& g) {
  std::vector<Expr> forms;
  for (const ByteForm& form : plain_char_forms()) {
    std::vector<Expr> bytes;
    for (const ByteSet& set : form) bytes.push_back(Grammar::bytes(set));
    forms.push_back(g.seq(bytes));
  }
  return Grammar::alt(forms);
}

}  // namespace

JsonPieces::JsonPieces(Grammar& g) : g_(g) {
  const Expr digit = Grammar::bytes(bytes('0', '9'));
  const Expr hex = Grammar::bytes(ByteSet().add('0', '9').add('a', 'f').add('A', 'F'));
  space_ = g.rule(Grammar::alt({Grammar::empty(), Grammar::literal(" "),
                                g.seq({Grammar::literal("\n"), g.repeat(Grammar::bytes(ByteSet().add(' ', ' ').add('\t', '\t')), 0, 20)})}));
  // \uXXXX: a code point outside the surrogates, or a surrogate pair, which
  // is one character (as minLength counts them); a lone surrogate is none
  // (a strict parser refuses it, and it is no UTF-8).
  const Expr d = Grammar::bytes(ByteSet().add('d', 'd').add('D', 'D'));
  const Expr not_d = Grammar::bytes(ByteSet().add('0', '9').add('a', 'c').add('e', 'f').add('A', 'C').add('E', 'F'));
  const Expr code_point = Grammar::alt({g.seq({not_d, hex, hex, hex}), g.seq({d, Grammar::bytes(bytes('0', '7')), hex, hex})});
  const Expr high = g.seq({d, Grammar::bytes(ByteSet().add('8', '9').add('a', 'b').add('A', 'B')), hex, hex});
  const Expr low = g.seq({d, Grammar::bytes(ByteSet().add('c', 'f').add('C', 'F')), hex, hex});
  const Expr escape = g.seq({Grammar::literal("\\"),
                             Grammar::alt({Grammar::bytes(ByteSet().add('"', '"').add('\\', '\\').add('/', '/').add('b', 'b')
                                                              .add('f', 'f').add('n', 'n').add('r', 'r').add('t', 't')),
                                           g.seq({Grammar::literal("u"), code_point}),
                                           g.seq({Grammar::literal("u"), high, Grammar::literal("\\u"), low})})});
  char_ = g.rule(Grammar::alt({utf8_char(g), escape}));
  string_ = g.rule(g.seq({Grammar::literal("\""), g.star(string_char()), Grammar::literal("\"")}));
  const Expr natural = Grammar::alt({Grammar::literal("0"), g.seq({Grammar::bytes(bytes('1', '9')), g.repeat(digit, 0, 15)})});
  integer_ = g.rule(g.seq({g.optional(Grammar::literal("-")), natural}));
  number_ = g.rule(g.seq({integer(), g.optional(g.seq({Grammar::literal("."), g.repeat(digit, 1, 16)})),
                          g.optional(g.seq({Grammar::bytes(ByteSet().add('e', 'e').add('E', 'E')),
                                            g.optional(Grammar::bytes(ByteSet().add('-', '-').add('+', '+'))),
                                            g.repeat(digit, 1, 2)}))}));  // (finite as a double: 3 digits reached 1e999, which parsers refuse or make infinite)
  value_ = g.declare();
  object_ = g.declare();
  array_ = g.declare();
  const Expr comma = g.seq({Grammar::literal(","), space()});
  const Expr any_member = member(string(), value());
  g.define(object_, g.seq({Grammar::literal("{"), space(), g.optional(g.seq({g.repeat(any_member, 1, -1, &comma)})),
                           Grammar::literal("}")}));
  const Expr item = g.seq({value(), space()});
  g.define(array_, g.seq({Grammar::literal("["), space(), g.optional(g.repeat(item, 1, -1, &comma)), Grammar::literal("]")}));
  g.define(value_, Grammar::alt({object(), array(), string(), number(), boolean(), null()}));
}

Expr JsonPieces::member(const Expr& key, const Expr& value) const {
  return g_.seq({key, space(), Grammar::literal(":"), space(), value, space()});
}

Grammar json_object_grammar() {
  Grammar g;
  JsonPieces json(g);
  g.define(0, json.object());
  return g;
}

}  // namespace disagg::grammar
