// Fuzzes the frontend's GGUF reader: arbitrary bytes as a GGUF file, read in memory
// (GgufFile::FromBytes, the parser Open runs over the mapped file). Reading never crashes,
// hangs or allocates out of proportion to the input (libFuzzer's -rss_limit_mb and
// -malloc_limit_mb stop an input that does); a file that reads has every tensor with data
// inside the file (ASan sees a read past the copy's end), dequantizes or fails with a status,
// answers every typed metadata accessor with a value or a status, loads as a Llama model
// (LlamaModel::Load: hyperparameters and tensors) or fails with a status, and, when it carries
// a tokenizer, builds one (or fails with a status) that encodes and decodes a short text.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "kvq/frontend/gguf.h"
#include "kvq/frontend/llama.h"
#include "kvq/frontend/tokenizer.h"

namespace {

void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_gguf: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using kvq::frontend::GgufFile;
  auto f = GgufFile::FromBytes(std::string(reinterpret_cast<const char*>(data), size));
  if (!f.ok()) return 0;
  const GgufFile& g = **f;
  for (const auto& [key, value] : g.metadata()) {
    (void)g.GetInt(key);
    (void)g.GetFloat(key);
    (void)g.GetBool(key);
    (void)g.GetString(key);
    (void)g.GetStringArray(key);
    (void)g.GetIntArray(key);
  }
  for (const auto& t : g.tensors()) {
    Check(t.numel() > 0, "a tensor without elements");
    if (t.data == nullptr) continue;  // a type the reader does not decode
    // The tensor's bytes lie inside the file: the element count's bytes are at most the size.
    Check(t.bytes() <= size, "a tensor larger than the file");
    auto d = g.Dequantize(t.name);
    // FindTensor finds the first tensor of a name: a later one of the same name may differ.
    if (d.ok() && g.FindTensor(t.name) == &t) {
      Check(static_cast<int64_t>(d->size()) == t.numel(), "dequantized size != numel");
    }
  }
  // The model loader: its hyperparameters and tensors, checked against each other.
  if (auto model = kvq::frontend::LlamaModel::Load(g); model.ok()) {
    const auto& c = (*model)->config();
    Check(c.layers >= 1 && c.q_heads >= 1 && c.kv_heads >= 1 && c.head_dim >= 1,
          "a model without heads");
  }
  if (auto tok = kvq::frontend::Tokenizer::FromGguf(g); tok.ok()) {
    const auto ids = (*tok)->Encode("Hello, world 123!\n");
    for (int32_t id : ids) Check(id >= 0 && id < (*tok)->vocab_size(), "token id out of range");
    (void)(*tok)->Decode(ids);
  }
  return 0;
}
