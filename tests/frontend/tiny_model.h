// A tiny synthetic Llama written as GGUF (random F32 weights, fixed seeds) for the frontend
// tests: llama_test's forward-pass checks, and with a byte-level tokenizer a model that the
// tools (kvq-calibrate, kvq-eval) run in a second.
#ifndef KVQ_TESTS_FRONTEND_TINY_MODEL_H_
#define KVQ_TESTS_FRONTEND_TINY_MODEL_H_

#include <memory>
#include <string>

#include "kvq/frontend/gguf.h"

namespace kvq::frontend {

// Hidden size, query heads, KV heads (head_dim 64), FFN size, vocabulary, layers.
inline constexpr int kH = 128, kHeads = 2, kKv = 1, kF = 96, kVocab = 40, kLayers = 2;
// The vocabulary with `byte_tokenizer`: one token per byte.
inline constexpr int kByteVocab = 256;

// What a tiny model file holds beyond the Llama tensors.
struct TinyOptions {
  std::string arch = "llama";
  bool biases = false;           // blk.N.attn_{q,k,v}.bias
  float output_scale = 0;        // > 0: output.weight = output_scale * token_embd.weight
  bool halves_to_pairs = false;  // permute Q/K rows (and biases) from halves to adjacent pairs
  std::string extra_tensor;      // a tensor the forward pass does not know
  std::string extra_key;         // an <arch>. metadata key it does not know (string "linear")
  // A GPT-2 byte-level BPE tokenizer without merges (token i = byte i, kByteVocab tokens),
  // so that any text tokenizes; the vocabulary is then kByteVocab instead of kVocab.
  bool byte_tokenizer = false;
};

// Writes the model under the test's temporary folder and returns its path.
std::string WriteTinyModel(const TinyOptions& o = {});
// The same, opened.
std::unique_ptr<GgufFile> TinyModel(const TinyOptions& o = {});

}  // namespace kvq::frontend

#endif  // KVQ_TESTS_FRONTEND_TINY_MODEL_H_
