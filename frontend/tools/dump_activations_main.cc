// kvq-dump-activations: writes post-RoPE Q, K, V of a few layers of a GGUF model on a slice of
// text, as fp16 tensors in one safetensors file, plus (optionally) those layers' HeadQ basis
// from a registry entry. Used to make tests/fixtures/frontend/activations.safetensors.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "flags.h"
#include "kvq/core/basis.h"
#include "kvq/core/half.h"
#include "kvq/frontend/attention_cache.h"
#include "kvq/frontend/blas_kernels.h"
#include "kvq/frontend/gguf.h"
#include "kvq/frontend/llama.h"
#include "kvq/frontend/model_and_text.h"
#include "kvq/frontend/model_files.h"
#include "kvq/frontend/tokenizer.h"
#include "nlohmann/json.hpp"

namespace kvq::frontend {
namespace {

constexpr char kHelp[] =
    R"(kvq-dump-activations: post-RoPE Q/K/V of some layers as fp16 safetensors.

Usage: kvq-dump-activations --out FILE [--model GGUF] [--text FILE] [--skip-tokens S]
                            [--tokens N] [--layers 3,20] [--basis DIR] [--rank R]

Tensors: layer.{l}.q F16 [q_heads, N, d], layer.{l}.k / layer.{l}.v F16 [kv_heads, N, d]
(positions 0..N-1 of one sequence starting at token S of the text), and with --basis
layer.{l}.u F32 [kv_heads, d, R] (first R columns). Metadata: model, text, skip, tokens.
)";

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "kvq-dump-activations: %s\n", std::string(s.ToString()).c_str());
  return 1;
}

int Main(int argc, char** argv) {
  Flags flags("dump_activations",
              {{"out", ""},
               {"model", DefaultModelPath()},
               {"text", DataFile("wikitext-2/wiki.valid.tokens")},
               {"skip-tokens", "40000"},
               {"tokens", "256"},
               {"layers", "3,20"},
               {"basis", ""},
               {"rank", "4"}},
              kHelp);
  int rc = 0;
  if (!flags.Parse(argc, argv, &rc)) return rc;
  if (flags.Get("out").empty()) return Fail(absl::InvalidArgumentError("--out is required"));
  SetBlasThreads(2);
  auto loaded = LoadModelAndText(flags.Get("model"), flags.Get("text"));
  if (!loaded.ok()) return Fail(loaded.status());
  const LlamaModel& model = *loaded->model;
  std::vector<int32_t> ids = std::move(loaded->ids);
  const int64_t skip = flags.GetInt("skip-tokens");
  const int n = static_cast<int>(flags.GetInt("tokens"));
  if (static_cast<int64_t>(ids.size()) < skip + n)
    return Fail(absl::InvalidArgumentError("text too short"));
  std::vector<int> layers;
  for (absl::string_view s : absl::StrSplit(flags.Get("layers"), ',')) {
    int l;
    if (!absl::SimpleAtoi(s, &l)) return Fail(absl::InvalidArgumentError("bad --layers"));
    layers.push_back(l);
  }
  const LlamaConfig& c = model.config();
  const int D = c.head_dim;
  std::map<int, std::vector<float>> q, k, v;
  auto hook = [&](int layer, int64_t, int m, const float* qq, const float* kk, const float* vv) {
    if (std::find(layers.begin(), layers.end(), layer) == layers.end()) return;
    q[layer].assign(qq, qq + static_cast<size_t>(c.q_heads) * m * D);
    auto& K = k[layer];
    auto& V = v[layer];
    K.resize(static_cast<size_t>(c.kv_heads) * m * D);
    V.resize(K.size());
    for (int h = 0; h < c.kv_heads; ++h)
      for (int t = 0; t < m; ++t)
        for (int j = 0; j < D; ++j) {
          K[(static_cast<size_t>(h) * m + t) * D + j] =
              kk[(static_cast<size_t>(t) * c.kv_heads + h) * D + j];
          V[(static_cast<size_t>(h) * m + t) * D + j] =
              vv[(static_cast<size_t>(t) * c.kv_heads + h) * D + j];
        }
  };
  DenseCache cache(c.cache_shape());
  absl::Status st = model.Forward(ids.data() + skip, n, 0, &cache, n, nullptr, hook);
  if (!st.ok()) return Fail(st);
  core::ModelBasis basis;
  const int R = static_cast<int>(flags.GetInt("rank"));
  if (!flags.Get("basis").empty()) {
    auto b = ReadBasisFor(model.config(), flags.Get("basis"));
    if (!b.ok()) return Fail(b.status());
    basis = std::move(*b);
    if (basis.manifest.rank < R) return Fail(absl::InvalidArgumentError("basis rank < --rank"));
  }
  nlohmann::json header;
  std::string data;
  auto add = [&](const std::string& name, const std::vector<float>& x, std::vector<int64_t> shape,
                 bool f16) {
    const size_t begin = data.size();
    if (f16) {
      std::vector<uint16_t> h(x.size());
      core::FloatToHalfN(x.data(), h.data(), x.size());
      data.append(reinterpret_cast<const char*>(h.data()), h.size() * 2);
    } else {
      data.append(reinterpret_cast<const char*>(x.data()), x.size() * 4);
    }
    header[name] = {
        {"dtype", f16 ? "F16" : "F32"}, {"shape", shape}, {"data_offsets", {begin, data.size()}}};
  };
  for (int l : layers) {
    add(absl::StrCat("layer.", l, ".q"), q[l], {c.q_heads, n, D}, true);
    add(absl::StrCat("layer.", l, ".k"), k[l], {c.kv_heads, n, D}, true);
    add(absl::StrCat("layer.", l, ".v"), v[l], {c.kv_heads, n, D}, true);
    if (!basis.u.empty()) {
      std::vector<float> u(static_cast<size_t>(c.kv_heads) * D * R);
      for (int h = 0; h < c.kv_heads; ++h)
        for (int i = 0; i < D; ++i)
          for (int r = 0; r < R; ++r)
            u[(static_cast<size_t>(h) * D + i) * R + r] =
                basis.head(l, h)[i * basis.manifest.rank + r];
      add(absl::StrCat("layer.", l, ".u"), u, {c.kv_heads, D, R}, false);
    }
  }
  header["__metadata__"] = {
      {"model", flags.Get("model").substr(flags.Get("model").rfind('/') + 1)},
      {"text", flags.Get("text").substr(flags.Get("text").rfind('/') + 1)},
      {"skip_tokens", std::to_string(skip)},
      {"tokens", std::to_string(n)},
      {"basis_kind", basis.u.empty() ? "" : basis.manifest.kind},
      {"basis_calibration_tokens", std::to_string(basis.manifest.calibration_tokens)}};
  std::string h = header.dump();
  while (h.size() % 8) h.push_back(' ');
  std::ofstream out(flags.Get("out"), std::ios::binary);
  const uint64_t hl = h.size();
  out.write(reinterpret_cast<const char*>(&hl), 8);
  out << h << data;
  if (!out) return Fail(absl::InternalError("write failed"));
  std::fprintf(stderr, "kvq-dump-activations: wrote %s (%zu bytes of tensors)\n",
               flags.Get("out").c_str(), data.size());
  return 0;
}

}  // namespace
}  // namespace kvq::frontend

int main(int argc, char** argv) {
  kvq::frontend::PreferNativeBlasKernels(argv);
  return kvq::frontend::Main(argc, argv);
}
