#include "kvq/frontend/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <climits>

#include "absl/strings/str_cat.h"
#include "kvq/core/status.h"

namespace kvq::frontend {
namespace {

void AppendUtf8(uint32_t cp, std::string* s) {
  if (cp < 0x80) {
    s->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    s->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    s->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    s->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    s->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

size_t Utf8Len(unsigned char c) {
  if (c < 0x80) return 1;
  if ((c >> 5) == 0x6) return 2;
  if ((c >> 4) == 0xE) return 3;
  if ((c >> 3) == 0x1E) return 4;
  return 1;  // invalid lead byte: treat as one unit
}

// One compiled PCRE2 pattern; Split() returns matched and unmatched segments in order.
class Pattern {
 public:
  static absl::StatusOr<std::unique_ptr<Pattern>> Compile(const std::string& re) {
    int err = 0;
    PCRE2_SIZE off = 0;
    pcre2_code* code =
        pcre2_compile(reinterpret_cast<PCRE2_SPTR>(re.data()), re.size(),
                      PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &err, &off, nullptr);
    if (!code) {
      PCRE2_UCHAR buf[256];
      pcre2_get_error_message(err, buf, sizeof(buf));
      return absl::InvalidArgumentError(
          absl::StrCat("PCRE2 compile of ", re, " at ", off, ": ", reinterpret_cast<char*>(buf)));
    }
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // best effort: interpreted if JIT is absent
    auto p = std::make_unique<Pattern>();
    p->code_ = code;
    return p;
  }
  ~Pattern() {
    if (code_) pcre2_code_free(code_);
  }
  void Split(std::string_view s, std::vector<std::string>* out) const {
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    size_t pos = 0, last = 0;
    // The first match checks that the whole subject is valid UTF-8; later ones skip that check
    // (repeating it per match made splitting quadratic in the text length).
    uint32_t options = 0;
    while (pos < s.size()) {
      int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos, options,
                           md, nullptr);
      if (rc < 0) break;
      options = PCRE2_NO_UTF_CHECK;
      PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      size_t b = ov[0], e = ov[1];
      if (e == b) {  // empty match: step one character
        pos = b + Utf8Len(static_cast<unsigned char>(s[b]));
        continue;
      }
      if (b > last) out->emplace_back(s.substr(last, b - last));
      out->emplace_back(s.substr(b, e - b));
      pos = last = e;
    }
    if (last < s.size()) out->emplace_back(s.substr(last));
    pcre2_match_data_free(md);
  }

 private:
  pcre2_code* code_ = nullptr;
};

}  // namespace

struct Tokenizer::Regexes {
  std::vector<std::unique_ptr<Pattern>> stages;
};

Tokenizer::~Tokenizer() = default;

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Create(std::vector<std::string> tokens,
                                                             const std::vector<std::string>& merges,
                                                             const std::string& pre) {
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  t->tokens_ = std::move(tokens);
  for (size_t i = 0; i < t->tokens_.size(); ++i)
    t->token_id_.emplace(t->tokens_[i], static_cast<int32_t>(i));
  for (size_t r = 0; r < merges.size(); ++r) {
    const std::string& m = merges[r];
    // Merges are "left right"; a token never contains a raw space (it is mapped to U+0120).
    size_t sp = m.find(' ', 1);
    if (sp == std::string::npos) return absl::InvalidArgumentError(absl::StrCat("bad merge: ", m));
    t->merge_rank_.emplace(m.substr(0, sp) + '\x01' + m.substr(sp + 1), static_cast<int32_t>(r));
  }
  RETURN_IF_ERROR(t->Init(pre));
  return t;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromGguf(const GgufFile& f) {
  ASSIGN_OR_RETURN(std::string model, f.GetString("tokenizer.ggml.model"));
  if (model != "gpt2") {
    return absl::UnimplementedError(absl::StrCat("tokenizer model ", model, " (only gpt2 BPE)"));
  }
  std::string pre = "default";
  if (auto p = f.GetString("tokenizer.ggml.pre"); p.ok()) pre = *p;
  ASSIGN_OR_RETURN(std::vector<std::string> tokens, f.GetStringArray("tokenizer.ggml.tokens"));
  ASSIGN_OR_RETURN(std::vector<std::string> merges, f.GetStringArray("tokenizer.ggml.merges"));
  ASSIGN_OR_RETURN(auto t, Create(std::move(tokens), merges, pre));
  if (auto v = f.GetInt("tokenizer.ggml.bos_token_id"); v.ok()) t->bos_ = static_cast<int32_t>(*v);
  if (auto v = f.GetInt("tokenizer.ggml.eos_token_id"); v.ok()) t->eos_ = static_cast<int32_t>(*v);
  if (auto v = f.GetBool("tokenizer.ggml.add_bos_token"); v.ok()) t->add_bos_ = *v;
  return t;
}

std::vector<std::string> Tokenizer::ByteSymbols() {
  // Printable bytes map to themselves, the rest to U+0100 onwards.
  std::vector<std::string> out(256);
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable =
        (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    AppendUtf8(printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + n++), &out[b]);
  }
  return out;
}

absl::Status Tokenizer::Init(const std::string& pre) {
  const std::vector<std::string> symbols = ByteSymbols();
  for (int b = 0; b < 256; ++b) {
    byte_to_unicode_[b] = symbols[b];
    unicode_to_byte_[symbols[b]] = static_cast<uint8_t>(b);
  }
  const std::string gpt2 =
      "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
  // Qwen2's: contractions in either case (spelled as classes, since PCRE2's caseless mode
  // would also fold U+017F and U+212A into s and k), letters with at most one leading
  // non-letter, each digit alone, punctuation runs with the newlines after them, newline runs
  // with the spaces before them, then whitespace as in GPT-2.
  const std::string qwen2 =
      "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
      "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
  std::vector<std::string> stages;
  if (pre == "smollm") {
    stages = {"\\p{N}", gpt2};
  } else if (pre == "gpt2" || pre == "default") {
    stages = {gpt2};
  } else if (pre == "qwen2") {
    stages = {qwen2};
  } else {
    return absl::UnimplementedError(absl::StrCat(
        "tokenizer.ggml.pre ", pre, " is not supported (smollm, gpt2, default, qwen2)"));
  }
  re_ = std::make_unique<Regexes>();
  for (const auto& s : stages) {
    ASSIGN_OR_RETURN(auto p, Pattern::Compile(s));
    re_->stages.push_back(std::move(p));
  }
  return absl::OkStatus();
}

std::vector<std::string> Tokenizer::PreTokenize(std::string_view text) const {
  std::vector<std::string> pieces{std::string(text)};
  for (const auto& stage : re_->stages) {
    std::vector<std::string> next;
    for (const auto& p : pieces) stage->Split(p, &next);
    pieces.swap(next);
  }
  return pieces;
}

void Tokenizer::EncodePiece(const std::string& piece, std::vector<int32_t>* out) const {
  auto it = cache_.find(piece);
  if (it != cache_.end()) {
    out->insert(out->end(), it->second.begin(), it->second.end());
    return;
  }
  std::vector<std::string> sym;
  for (unsigned char c : piece) sym.push_back(byte_to_unicode_[c]);
  std::string key;
  while (sym.size() > 1) {
    int best = INT_MAX;
    size_t best_i = 0;
    for (size_t i = 0; i + 1 < sym.size(); ++i) {
      key.assign(sym[i]);
      key.push_back('\x01');
      key.append(sym[i + 1]);
      auto m = merge_rank_.find(key);
      if (m != merge_rank_.end() && m->second < best) {
        best = m->second;
        best_i = i;
      }
    }
    if (best == INT_MAX) break;
    sym[best_i] += sym[best_i + 1];
    sym.erase(sym.begin() + static_cast<long>(best_i) + 1);
  }
  std::vector<int32_t> ids;
  for (const auto& s : sym) {
    auto t = token_id_.find(s);
    if (t != token_id_.end()) {
      ids.push_back(t->second);
      continue;
    }
    // Not in the vocabulary: fall back to one token per byte's symbol.
    for (size_t i = 0; i < s.size();) {
      size_t l = Utf8Len(static_cast<unsigned char>(s[i]));
      auto b = token_id_.find(s.substr(i, l));
      if (b != token_id_.end()) ids.push_back(b->second);
      i += l;
    }
  }
  out->insert(out->end(), ids.begin(), ids.end());
  if (cache_.size() < 1'000'000) cache_.emplace(piece, std::move(ids));
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text) const {
  std::vector<int32_t> out;
  for (const auto& p : PreTokenize(text)) EncodePiece(p, &out);
  return out;
}

std::string Tokenizer::Decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size()) continue;
    const std::string& t = tokens_[id];
    for (size_t i = 0; i < t.size();) {
      size_t l = Utf8Len(static_cast<unsigned char>(t[i]));
      auto b = unicode_to_byte_.find(t.substr(i, l));
      if (b != unicode_to_byte_.end())
        out.push_back(static_cast<char>(b->second));
      else
        out.append(t, i, l);  // control tokens such as <|im_start|> decode as themselves
      i += l;
    }
  }
  return out;
}

}  // namespace kvq::frontend
