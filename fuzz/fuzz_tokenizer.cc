// Fuzzes the frontend's byte-level BPE tokenizer: arbitrary bytes as text to Encode, the ids
// back to Decode. The first byte picks the tokenizer:
//   bits 0-1  the pre-tokenizer: gpt2, smollm, qwen2, default
//   bit 2     the fixed vocabulary with a few merges (else none: the tiny model's byte
//             tokenizer, tests/frontend/tiny_model.cc, one token per byte)
//   bit 7     a vocabulary parsed from the input instead: up to the first NUL, lines ('\n')
//             with a space are merges in rank order ("left right"), the others tokens;
//             bit 6 clear adds the 256 byte tokens before them. The text is what follows the
//             NUL.
// Checked: the pre-tokenizer's pieces concatenate to the text (nothing dropped or
// repeated), every id is in the vocabulary, and Decode(Encode(text)) == text whenever every
// byte has its token (the tokenizer's promise: merges only join symbols, and a merged
// symbol missing from the vocabulary falls back to its bytes' tokens). Decode of arbitrary
// ids (the input's bytes as int32s, out-of-range ones included) never crashes.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/frontend/tokenizer.h"

namespace {

using kvq::frontend::Tokenizer;

const char* const kPre[4] = {"gpt2", "smollm", "qwen2", "default"};

// A few English merges (U+0120 "Ġ" is the space's symbol) and their tokens; one merge
// ("e r") has no token, so its symbol falls back to byte tokens.
const std::vector<std::string> kMerges = {"\xc4\xa0 t",
                                          "h e",
                                          "\xc4\xa0t he",
                                          "i n",
                                          "e r",
                                          "\xc4\xa0 a",
                                          "o n",
                                          "\xc4\xa0"
                                          "a n",
                                          "in g",
                                          "1 2"};
const std::vector<std::string> kMergedTokens = {"\xc4\xa0t",
                                                "he",
                                                "\xc4\xa0the",
                                                "in",
                                                "\xc4\xa0"
                                                "a",
                                                "on",
                                                "\xc4\xa0"
                                                "an",
                                                "ing",
                                                "12"};

// The fixed tokenizers, built once: [pre][with merges].
const Tokenizer& Fixed(int pre, bool merges) {
  static std::unique_ptr<Tokenizer> made[4][2];
  std::unique_ptr<Tokenizer>& t = made[pre][merges];
  if (!t) {
    std::vector<std::string> vocab = Tokenizer::ByteSymbols();
    if (merges) vocab.insert(vocab.end(), kMergedTokens.begin(), kMergedTokens.end());
    auto c = Tokenizer::Create(vocab, merges ? kMerges : std::vector<std::string>{}, kPre[pre]);
    if (!c.ok()) {
      std::fprintf(stderr, "fuzz_tokenizer: %s\n", std::string(c.status().message()).c_str());
      std::abort();
    }
    t = std::move(*c);
  }
  return *t;
}

void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_tokenizer: %s\n", what);
    std::abort();
  }
}

void Run(const Tokenizer& tok, std::string_view text, bool every_byte_has_a_token) {
  std::string joined;
  for (const auto& p : tok.PreTokenize(text)) joined += p;
  Check(joined == text, "the pre-tokenizer's pieces do not concatenate to the text");
  const std::vector<int32_t> ids = tok.Encode(text);
  for (int32_t id : ids)
    Check(id >= 0 && id < tok.vocab_size(), "a token id outside the vocabulary");
  const std::string back = tok.Decode(ids);
  if (every_byte_has_a_token) Check(back == text, "Decode(Encode(text)) != text");
  // Arbitrary ids: the text's bytes as int32s (negative and too large ones included).
  std::vector<int32_t> raw(text.size() / 4);
  if (!raw.empty()) std::memcpy(raw.data(), text.data(), raw.size() * 4);
  (void)tok.Decode(raw);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  const int pre = mode & 3;
  if (!(mode & 0x80)) {
    Run(Fixed(pre, (mode & 4) != 0), rest, true);
    return 0;
  }
  const size_t nul = rest.find('\0');
  const std::string_view table = rest.substr(0, nul);
  const std::string_view text =
      nul == std::string_view::npos ? std::string_view() : rest.substr(nul + 1);
  const bool bytes = !(mode & 0x40);
  std::vector<std::string> vocab = bytes ? Tokenizer::ByteSymbols() : std::vector<std::string>{};
  std::vector<std::string> merges;
  for (size_t at = 0; at <= table.size();) {
    size_t end = table.find('\n', at);
    if (end == std::string_view::npos) end = table.size();
    const std::string line(table.substr(at, end - at));
    if (line.find(' ') != std::string::npos)
      merges.push_back(line);
    else if (!line.empty())
      vocab.push_back(line);
    at = end + 1;
  }
  auto tok = Tokenizer::Create(std::move(vocab), merges, kPre[pre]);
  if (!tok.ok()) return 0;  // a bad merge (no space after its first character)
  Run(**tok, text, bytes);
  return 0;
}
