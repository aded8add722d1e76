// Tokenizer on a small synthetic vocabulary: GPT-2 byte mapping, merge order by rank, the
// smollm pre-tokenizer (digits split off, contractions, spaces, lookahead) and round trips.
// The real vocabulary is checked against llama.cpp in real_model_test.cc.
#include "kvq/frontend/tokenizer.h"

#include "gtest/gtest.h"

namespace kvq::frontend {
namespace {

std::vector<std::string> Pieces(const Tokenizer& t, const std::string& s) {
  return t.PreTokenize(s);
}

std::unique_ptr<Tokenizer> Make(const std::string& pre) {
  // Byte symbols for every byte, then merged tokens. "\xc4\xa0" is the GPT-2 symbol of ' '.
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) {
    const bool printable =
        (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    int cp = b;
    if (!printable) {
      static int n = 0;
      cp = 256 + (n++ % 68);
    }
    std::string s;
    if (cp < 0x80)
      s.push_back(static_cast<char>(cp));
    else {
      s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    tokens.push_back(s);
  }
  for (const char* t : {"he", "ll", "hell", "hello", "\xc4\xa0w", "\xc4\xa0wo", "\xc4\xa0wor",
                        "\xc4\xa0world", "lo"})
    tokens.push_back(t);
  std::vector<std::string> merges = {"h e",        "l l",         "he ll",        "hell o",
                                     "\xc4\xa0 w", "\xc4\xa0w o", "\xc4\xa0wo r", "\xc4\xa0wor ld",
                                     "l o",        "l d"};
  tokens.push_back("ld");
  auto t = Tokenizer::Create(tokens, merges, pre);
  EXPECT_TRUE(t.ok()) << t.status();
  return std::move(*t);
}

TEST(Tokenizer, SmollmPreTokenizerSplitsDigitsAndWords) {
  auto t = Make("smollm");
  EXPECT_EQ(Pieces(*t, "abc123 def"), (std::vector<std::string>{"abc", "1", "2", "3", " def"}));
  EXPECT_EQ(Pieces(*t, "I'll don't"), (std::vector<std::string>{"I", "'ll", " don", "'t"}));
  // \s+(?!\S): of several spaces before a word, the last one joins the word.
  EXPECT_EQ(Pieces(*t, "a   b"), (std::vector<std::string>{"a", "  ", " b"}));
  // "\n\nz": \s+(?!\S) takes only the first newline, then \s+ the second (as llama.cpp does).
  EXPECT_EQ(Pieces(*t, "x!!? y\n\nz"),
            (std::vector<std::string>{"x", "!!?", " y", "\n", "\n", "z"}));
  EXPECT_EQ(Pieces(*t, "x\n\n"), (std::vector<std::string>{"x", "\n\n"}));
  // Unicode letters (\p{L}) and numbers (\p{N}) need UCP: "é" is a letter, "²" a number.
  EXPECT_EQ(Pieces(*t, "caf\xc3\xa9 x\xc2\xb2"),
            (std::vector<std::string>{"caf\xc3\xa9", " x", "\xc2\xb2"}));
  // gpt2 (no digit split) keeps numbers together.
  auto g = Make("gpt2");
  EXPECT_EQ(Pieces(*g, "abc123"), (std::vector<std::string>{"abc", "123"}));
}

TEST(Tokenizer, Qwen2PreTokenizer) {
  auto t = Make("qwen2");
  using V = std::vector<std::string>;
  EXPECT_EQ(Pieces(*t, "abc123 def"), (V{"abc", "1", "2", "3", " def"}));
  // Contractions in either case; one leading non-letter (" ", ",") joins the letters, two
  // (" $") do not.
  EXPECT_EQ(Pieces(*t, "I'LL don't,x $hello"), (V{"I", "'LL", " don", "'t", ",x", " $", "hello"}));
  // Punctuation keeps the newlines after it; a newline run keeps the spaces before it.
  EXPECT_EQ(Pieces(*t, "x!!? y\n\nz"), (V{"x", "!!?", " y", "\n\n", "z"}));
  EXPECT_EQ(Pieces(*t, "a.\n\nb"), (V{"a", ".\n\n", "b"}));
  EXPECT_EQ(Pieces(*t, "a  \n  x"), (V{"a", "  \n", " ", " x"}));
  EXPECT_EQ(Pieces(*t, "a   b"), (V{"a", "  ", " b"}));
  EXPECT_EQ(Pieces(*t, "caf\xc3\xa9 x\xc2\xb2"), (V{"caf\xc3\xa9", " x", "\xc2\xb2"}));
  // U+017F (long s) is not an 's' to the contraction rule: "'\u017fx" stays one piece (a
  // caseless "(?i:'s)" would split off "'\u017f").
  EXPECT_EQ(Pieces(*t, "a'\xc5\xbfx"), (V{"a", "'\xc5\xbfx"}));
}

TEST(Tokenizer, MergesApplyByRankAndRoundTrip) {
  auto t = Make("smollm");
  const int base = 256;
  // "hello" -> h e l l o -> (he)(ll)o -> (hell)o -> hello
  EXPECT_EQ(t->Encode("hello"), (std::vector<int32_t>{base + 3}));
  EXPECT_EQ(t->Encode("hello world"), (std::vector<int32_t>{base + 3, base + 7}));
  // "ll" outranks "lo": "llo" -> (ll) o, not l (lo).
  EXPECT_EQ(t->Encode("llo"), (std::vector<int32_t>{base + 1, 'o'}));
  for (const std::string& s : std::vector<std::string>{"hello world", "caf\xc3\xa9 12 \t\n x",
                                                       std::string("\x00\x01\xff", 3)}) {
    EXPECT_EQ(t->Decode(t->Encode(s)), s);
  }
}

TEST(Tokenizer, RejectsUnknownPreTokenizer) {
  EXPECT_FALSE(Tokenizer::Create({"a"}, {}, "klingon").ok());
  EXPECT_FALSE(Tokenizer::Create({"a"}, {"nospace"}, "gpt2").ok());
}

}  // namespace
}  // namespace kvq::frontend
