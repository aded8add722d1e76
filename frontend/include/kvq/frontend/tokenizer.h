// Byte-level BPE tokenizer as described by a GGUF file's metadata (tokenizer.ggml.model =
// "gpt2"): GPT-2 byte-to-unicode mapping, merges applied by rank (lowest first), and the
// pre-tokenizer named by tokenizer.ggml.pre ("smollm": every digit on its own, then the GPT-2
// pattern; "gpt2"; "qwen2": llama.cpp's Qwen2 pattern), run with PCRE2 in UTF + UCP mode. Special
// (control) tokens in the text are not parsed: text is tokenized as plain text, like llama.cpp's
// tokenize with parse_special off.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "kvq/frontend/gguf.h"

namespace kvq::frontend {

class Tokenizer {
 public:
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromGguf(const GgufFile& f);
  // Builds from explicit tables (tests). merges: "a b" strings in rank order.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Create(std::vector<std::string> tokens,
                                                           const std::vector<std::string>& merges,
                                                           const std::string& pre);
  ~Tokenizer();
  // GPT-2's bytes_to_unicode: the symbol (UTF-8) standing for each byte in tokens. Token b of
  // a byte-level vocabulary without merges (the tiny test model's, the fuzz target's).
  static std::vector<std::string> ByteSymbols();

  // Token ids of `text` (no BOS/EOS; see add_bos()).
  std::vector<int32_t> Encode(std::string_view text) const;
  // The bytes a token sequence stands for.
  std::string Decode(const std::vector<int32_t>& ids) const;
  // Pre-tokenizer pieces (for tests and diagnostics).
  std::vector<std::string> PreTokenize(std::string_view text) const;

  int vocab_size() const { return static_cast<int>(tokens_.size()); }
  int32_t bos() const { return bos_; }
  int32_t eos() const { return eos_; }
  bool add_bos() const { return add_bos_; }

 private:
  Tokenizer() = default;
  absl::Status Init(const std::string& pre);
  void EncodePiece(const std::string& piece, std::vector<int32_t>* out) const;

  std::vector<std::string> tokens_;
  std::unordered_map<std::string, int32_t> token_id_;
  std::unordered_map<std::string, int32_t> merge_rank_;  // key: left + '\x01' + right
  std::string byte_to_unicode_[256];
  std::unordered_map<std::string, uint8_t> unicode_to_byte_;
  struct Regexes;
  std::unique_ptr<Regexes> re_;
  int32_t bos_ = -1, eos_ = -1;
  bool add_bos_ = false;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

}  // namespace kvq::frontend
