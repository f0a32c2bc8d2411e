#include "grammar/json_grammar.h"

namespace disagg::grammar {

namespace {

ByteSet bytes(uint8_t lo, uint8_t hi) { return ByteSet::range(lo, hi); }

// One character of valid UTF-8 that JSON writes unescaped in a string: not
// '"', '\\' or a control character; multi-byte sequences as RFC 3629 allows.
Expr utf8_char(Grammar& g) {
  const ByteSet tail = bytes(0x80, 0xBF);
  const Expr t = Grammar::bytes(tail);
  return Grammar::alt({
      Grammar::bytes(ByteSet().add(0x20, 0x21).add(0x23, 0x5B).add(0x5D, 0x7E)),
      g.seq({Grammar::bytes(bytes(0xC2, 0xDF)), t}),
      g.seq({Grammar::literal("\xE0"), Grammar::bytes(bytes(0xA0, 0xBF)), t}),
      g.seq({Grammar::bytes(ByteSet().add(0xE1, 0xEC).add(0xEE, 0xEF)), t, t}),
      g.seq({Grammar::literal("\xED"), Grammar::bytes(bytes(0x80, 0x9F)), t}),
      g.seq({Grammar::literal("\xF0"), Grammar::bytes(bytes(0x90, 0xBF)), t, t}),
      g.seq({Grammar::bytes(bytes(0xF1, 0xF3)), t, t, t}),
      g.seq({Grammar::literal("\xF4"), Grammar::bytes(bytes(0x80, 0x8F)), t, t}),
  });
}

}  // namespace

JsonPieces::JsonPieces(Grammar& g) : g_(g) {
  const Expr digit = Grammar::bytes(bytes('0', '9'));
  const Expr hex = Grammar::bytes(ByteSet().add('0', '9').add('a', 'f').add('A', 'F'));
  space_ = g.rule(Grammar::alt({Grammar::empty(), Grammar::literal(" "),
                                g.seq({Grammar::literal("\n"), g.repeat(Grammar::bytes(ByteSet().add(' ', ' ').add('\t', '\t')), 0, 20)})}));
  const Expr escape = g.seq({Grammar::literal("\\"),
                             Grammar::alt({Grammar::bytes(ByteSet().add('"', '"').add('\\', '\\').add('/', '/').add('b', 'b')
                                                              .add('f', 'f').add('n', 'n').add('r', 'r').add('t', 't')),
                                           g.seq({Grammar::literal("u"), hex, hex, hex, hex})})});
  char_ = g.rule(Grammar::alt({utf8_char(g), escape}));
  string_ = g.rule(g.seq({Grammar::literal("\""), g.star(string_char()), Grammar::literal("\"")}));
  const Expr natural = Grammar::alt({Grammar::literal("0"), g.seq({Grammar::bytes(bytes('1', '9')), g.repeat(digit, 0, 15)})});
  integer_ = g.rule(g.seq({g.optional(Grammar::literal("-")), natural}));
  number_ = g.rule(g.seq({integer(), g.optional(g.seq({Grammar::literal("."), g.repeat(digit, 1, 16)})),
                          g.optional(g.seq({Grammar::bytes(ByteSet().add('e', 'e').add('E', 'E')),
                                            g.optional(Grammar::bytes(ByteSet().add('-', '-').add('+', '+'))),
                                            g.repeat(digit, 1, 3)}))}));
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
