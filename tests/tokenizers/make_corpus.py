#!/usr/bin/env python3
"""Writes tests/tokenizers/corpus.txt: the tokenizer test corpus, records
separated by the byte 0x1E (a record may hold newlines). Deterministic (seed
2026); rerun after changing the fragments below:
    python3 tests/tokenizers/make_corpus.py
Each record joins 1-4 fragments drawn from: sentences in many scripts,
numbers, emoji with skin tones, ZWJ sequences and flags, whitespace runs,
code, contractions, special-token text (whole, partial, glued to words),
decomposed accents (NFC differs), and ill-formed UTF-8, plus a few long
records (runs of one class of character)."""
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, there was a little girl named Lily.",
    "She didn't know what to do, so she asked her mom.",
    "I'm sure we'll be fine; they've said it's OK, haven't they?",
    "DON'T SHOUT, I'LL HEAR YOU, WE'RE HERE, YOU'VE GOT IT, HE'D KNOW.",
    "It\u2019s a curly apostrophe \u2014 and \u201cquotes\u201d too\u2026",
    "Größere Äpfel schmecken süß; Straße, Übermut, Ökologie.",
    "Où est la bibliothèque ? C'est à côté de l'église, près du cœur.",
    "¿Dónde está el niño? ¡Mañana será otro día! Pingüino, ñandú.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία. Γειά σου Κόσμε!",
    "العربية لغة جميلة، وهي من أكثر اللغات انتشاراً في العالم.",
    "שלום עולם! זה משפט בעברית עם ניקוד: שָׁלוֹם.",
    "हिन्दी एक सुंदर भाषा है। क्षत्रिय, ज्ञान, श्री।",
    "বাংলা ভাষা খুব মিষ্টি। আমি তোমাকে ভালোবাসি।",
    "我们今天去公园散步，天气非常好。人工智能正在改变世界。",
    "東京は日本の首都です。ひらがな、カタカナ、漢字を使います。",
    "한국어는 아름다운 언어입니다. 안녕하세요, 반갑습니다!",
    "ภาษาไทยไม่มีการเว้นวรรคระหว่างคำ สวัสดีครับ",
    "Tiếng Việt có nhiều dấu: Người, được, những, thường xuyên.",
    "İstanbul'da ılık bir gün; IĞDIR, ığdır, şoför, çiçek.",
    "Ελληνικά, ქართული ენა, Հայերեն լեզու, ᏣᎳᎩ, ትግርኛ.",
    "Math: ∀x∈ℝ, x² ≥ 0; ∑ᵢ aᵢ = π ≈ 3.14159; ∞ ≠ ∅.",
    "Prices: $1,299.99, €45,00, £3.50, ¥10000, ₹2,50,000, ₿0.001.",
    "Emoji: 👍 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇩🇪🇯🇵 ❤️ 🤷‍♀️ 🧑🏿‍💻 1️⃣",
    "Zero\u200bwidth\u200cjoiner\u200dtest and a soft\u00adhyphen.",
    "Ligatures ﬁ ﬂ, full-width ＡＢＣ１２３, circled ①②③, roman Ⅻ.",
    "e\u0301le\u0300ve, n\u0303, A\u030a, o\u0308 (decomposed accents)",
    "Mixed: hello世界123abc!!!???...---___",
    "URL: https://example.com/path?query=1&x=y#frag, email a.b@c.de",
]

NUMBERS = ["0", "7", "42", "123", "1234", "12345", "123456789", "3.14159", "-273.15", "1e10", "0x1F",
           "2026-12-02", "12:34:56", "+1 (555) 123-4567", "١٢٣٤٥", "१२३४", "一二三", "Ⅳ", "½ ¾ ⅞",
           "9999999999999999", "1,000,000", "10.000,50"]

CODE = [
    "int main(int argc, char** argv) {\n  return argc > 1 ? 0 : 1;\n}",
    "def f(x):\n    return [i * i for i in range(x) if i % 2 == 0]\n",
    "{\"model\": \"stories260K\", \"max_tokens\": 16, \"stream\": true}",
    "for (size_t i = 0; i < n; ++i) sum += a[i] * b[i];  // dot",
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;",
    "if [ -f \"$x\" ]; then\n\techo \"ok\" >&2\nfi",
    "<div class=\"a\">&lt;tag&gt; &amp; &#x1F600;</div>",
    "x = y->z; p = &q; r = *s; t = u::v<w>();",
    "    \tindented with tabs\t\tand spaces    ",
    "#include <vector>\n#define MAX(a, b) ((a) > (b) ? (a) : (b))",
]

WHITESPACE = [" ", "  ", "   ", "        ", "\t", "\t\t", "\n", "\n\n", "\r\n", "\r\n\r\n", " \n ", "\n  \n",
              "\u00a0", "\u3000", " \t \n", "\n\n\n\n", "                                "]

SPECIAL = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>user<|end_header_id|>\n\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n", "<|im_start|>user\nHi<|im_end|>", "<|endoftext|>",
    "<think>\nhmm\n</think>", "<|reserved_special_token_0|>", "<|eot_id", "<|im_start", "<|", "|>", "<|>",
    "text<|eot_id|>text", "<|im_end|><|im_end|>", "<|fake_token|>", "<s>", "</s>", "[INST]", "<tool_call>",
]

CONTRACTIONS = ["I'm", "you're", "it's", "we've", "they'll", "she'd", "can't", "won't", "'s", "'S", "'ll",
                "ma'am", "rock'n'roll", "'quoted'", "o'clock", "DON'T", "We'Re"]

INVALID = [b"\xff", b"\xfe\xff", b"abc\xc3(def", b"\xe2\x82", b"\xed\xa0\x80", b"\xf0\x9f\x98", b"\xc0\xaf",
           b"\x80\x80", b"caf\xe9", b"\xf4\x90\x80\x80", b"ok\xe2\x82\xacok\xe2\x82"]


def fragment(rng):
    kind = rng.random()
    if kind < 0.35:
        return rng.choice(SENTENCES).encode()
    if kind < 0.45:
        return rng.choice(NUMBERS).encode()
    if kind < 0.55:
        return rng.choice(CODE).encode()
    if kind < 0.65:
        return rng.choice(WHITESPACE).encode()
    if kind < 0.75:
        return rng.choice(SPECIAL).encode()
    if kind < 0.85:
        return " ".join(rng.choice(CONTRACTIONS) for _ in range(rng.randint(1, 4))).encode()
    if kind < 0.92:
        return rng.choice(INVALID)
    # a slice of a sentence, cut at any code point
    s = rng.choice(SENTENCES)
    a = rng.randint(0, len(s) - 1)
    return s[a:a + rng.randint(1, 12)].encode()


def main():
    rng = random.Random(2026)
    records = []
    # Every fragment alone first, then random joins.
    for group in (SENTENCES, NUMBERS, CODE, WHITESPACE, SPECIAL, CONTRACTIONS):
        records += [x.encode() for x in group]
    records += INVALID
    while len(records) < 1100:
        parts = [fragment(rng) for _ in range(rng.randint(1, 4))]
        sep = rng.choice([b"", b" ", b"\n", b"  ", b"\t"])
        records.append(sep.join(parts))
    records += [b"a" * 5000, b" " * 3000, b"7" * 1000, "語".encode() * 1500, b"\n" * 500, b"!?" * 800,
                ("word " * 1000).encode(), b""]
    for r in records:
        assert b"\x1e" not in r
    with open(os.path.join(HERE, "corpus.txt"), "wb") as f:
        f.write(b"\x1e".join(records))
    print(len(records), "records")


if __name__ == "__main__":
    main()
