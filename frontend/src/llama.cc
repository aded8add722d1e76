#include "kvq/frontend/llama.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "kvq/core/status.h"

namespace kvq::frontend {
namespace {

// Y[n][out] = X[n][in] * W^T, W stored [out][in] (GGUF ne0 = in).
void MatMul(const float* x, const std::vector<float>& w, int n, int in, int out, float* y,
            float beta = 0.0f) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, out, in, 1.0f, x, in, w.data(), in, beta,
              y, out);
}

// The same product for S sequences of n rows each (x [S*n][in], y [S*n][out]), one call per
// sequence: a BLAS may sum a row differently with the row count of the call (OpenBLAS's
// Haswell/Zen kernels do; its SkylakeX ones do not), so a batched window's outputs would
// depend on the windows beside it. Per sequence they are the window's outputs alone, bit for
// bit, on every CPU, at a price: kvq-eval's decode-faithful chunks (32 rows a call instead of
// 32 x windows) took 1.2-1.5x the time on that CPU (8 windows of 512, one thread).
void MatMulEach(const float* x, const std::vector<float>& w, int S, int n, int in, int out,
                float* y, float beta = 0.0f) {
  for (int s = 0; s < S; ++s)
    MatMul(x + static_cast<size_t>(s) * n * in, w, n, in, out, y + static_cast<size_t>(s) * n * out,
           beta);
}

void RmsNorm(const float* x, const float* w, int n, int dim, float eps, float* y) {
  for (int i = 0; i < n; ++i) {
    const float* xi = x + static_cast<int64_t>(i) * dim;
    double ss = 0;
    for (int j = 0; j < dim; ++j) ss += static_cast<double>(xi[j]) * xi[j];
    const float r = 1.0f / std::sqrt(static_cast<float>(ss / dim) + eps);
    float* yi = y + static_cast<int64_t>(i) * dim;
    for (int j = 0; j < dim; ++j) yi[j] = xi[j] * r * w[j];
  }
}

absl::StatusOr<std::vector<float>> Load(const GgufFile& f, const std::string& name,
                                        std::vector<int64_t> dims) {
  const GgufTensorInfo* t = f.FindTensor(name);
  if (!t) return absl::NotFoundError(absl::StrCat("model: missing tensor ", name));
  if (t->dims != dims) {
    std::string got, want;
    for (auto d : t->dims) absl::StrAppend(&got, d, " ");
    for (auto d : dims) absl::StrAppend(&want, d, " ");
    return absl::InvalidArgumentError(
        absl::StrCat("model: tensor ", name, " has dims [", got, "], expected [", want, "]"));
  }
  return f.Dequantize(name);
}

void AddBias(const std::vector<float>& b, int n, float* y) {
  if (b.empty()) return;
  const size_t w = b.size();
  for (int i = 0; i < n; ++i)
    for (size_t j = 0; j < w; ++j) y[i * w + j] += b[j];
}

// The metadata keys under "<arch>." that the forward pass reads or knows to be harmless; any
// other key there may change the computation (rope scaling, sliding windows, logit caps...),
// so it is an error rather than silently ignored.
const std::set<std::string>& KnownArchKeys() {
  static const std::set<std::string> k = {"block_count",
                                          "context_length",
                                          "embedding_length",
                                          "feed_forward_length",
                                          "attention.head_count",
                                          "attention.head_count_kv",
                                          "attention.layer_norm_rms_epsilon",
                                          "rope.freq_base",
                                          "rope.dimension_count",
                                          "vocab_size",
                                          "attention.key_length",
                                          "attention.value_length"};
  return k;
}

}  // namespace

const char* RopeLayoutName(RopeLayout layout) {
  return layout == RopeLayout::kHalves ? "halves" : "adjacent_pairs";
}

void SetBlasThreads(int n) { openblas_set_num_threads(n); }

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Load(const GgufFile& f) {
  ASSIGN_OR_RETURN(std::string arch, f.GetString("general.architecture"));
  auto m = std::unique_ptr<LlamaModel>(new LlamaModel());
  LlamaConfig& c = m->cfg_;
  c.arch = arch;
  if (arch == "llama") {
    c.rope_layout = RopeLayout::kAdjacentPairs;
  } else if (arch == "qwen2") {
    c.rope_layout = RopeLayout::kHalves;
  } else {
    return absl::UnimplementedError(
        absl::StrCat("model: architecture ", arch, " is not supported (llama, qwen2)"));
  }
  for (const auto& [key, value] : f.metadata()) {
    if (key.rfind(arch + ".", 0) != 0) continue;
    const std::string sub = key.substr(arch.size() + 1);
    if (KnownArchKeys().count(sub)) continue;
    if (sub == "rope.scaling.type") {
      auto t = f.GetString(key);
      if (t.ok() && (*t == "none" || t->empty())) continue;
    }
    return absl::UnimplementedError(
        absl::StrCat("model: metadata ", key, " is not supported by the ", arch, " forward pass"));
  }
  auto geti = [&](const std::string& k) { return f.GetInt(arch + "." + k); };
  ASSIGN_OR_RETURN(int64_t layers, geti("block_count"));
  ASSIGN_OR_RETURN(int64_t hidden, geti("embedding_length"));
  ASSIGN_OR_RETURN(int64_t heads, geti("attention.head_count"));
  ASSIGN_OR_RETURN(int64_t ffn, geti("feed_forward_length"));
  int64_t kv = heads;
  if (auto v = geti("attention.head_count_kv"); v.ok()) kv = *v;
  ASSIGN_OR_RETURN(double eps, f.GetFloat(arch + ".attention.layer_norm_rms_epsilon"));
  double base = 10000.0;
  if (auto v = f.GetFloat(arch + ".rope.freq_base"); v.ok()) base = *v;
  // Each count in range before anything is sized by it: a corrupt block_count of -1 (or 2^32
  // - 1, an int of -1) resized the layers to 2^64 - 1 (an abort), and a billion made a
  // billion layers' tensor names. The bounds are far beyond any real model's.
  for (const auto& [k, v, hi] :
       {std::tuple<const char*, int64_t, int64_t>{"block_count", layers, 4096},
        {"embedding_length", hidden, int64_t{1} << 20},
        {"attention.head_count", heads, 4096},
        {"attention.head_count_kv", kv, 4096},
        {"feed_forward_length", ffn, int64_t{1} << 22}}) {
    if (v < 1 || v > hi) {
      return absl::InvalidArgumentError(
          absl::StrCat("model: ", arch, ".", k, " = ", v, " is outside 1..", hi));
    }
  }
  if (heads <= 0 || kv <= 0 || heads % kv != 0 || hidden % heads != 0) {
    return absl::InvalidArgumentError("model: inconsistent head counts");
  }
  c.layers = static_cast<int>(layers);
  c.hidden = static_cast<int>(hidden);
  c.q_heads = static_cast<int>(heads);
  c.kv_heads = static_cast<int>(kv);
  c.head_dim = static_cast<int>(hidden / heads);
  for (const char* k : {"attention.key_length", "attention.value_length"}) {
    if (auto v = geti(k); v.ok() && *v != c.head_dim) {
      return absl::UnimplementedError(absl::StrCat("model: ", arch, ".", k, " = ", *v,
                                                   " differs from hidden / heads = ", c.head_dim));
    }
  }
  c.ffn = static_cast<int>(ffn);
  c.rms_eps = static_cast<float>(eps);
  c.rope_base = static_cast<float>(base);
  int64_t rope_dims = c.head_dim;
  if (auto v = geti("rope.dimension_count"); v.ok()) rope_dims = *v;
  if (rope_dims <= 0 || rope_dims > c.head_dim || rope_dims % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model: ", arch, ".rope.dimension_count = ", rope_dims, " for head_dim ", c.head_dim));
  }
  c.rope_dims = static_cast<int>(rope_dims);
  if (auto v = geti("context_length"); v.ok()) c.context_length = *v;
  if (auto v = f.GetStringArray("tokenizer.ggml.tokens"); v.ok())
    c.vocab = static_cast<int>(v->size());
  const GgufTensorInfo* emb = f.FindTensor("token_embd.weight");
  if (!emb || emb->dims.size() != 2) return absl::NotFoundError("model: no token_embd.weight");
  c.vocab = static_cast<int>(emb->dims[1]);
  // Every tensor of the file must be one the forward pass uses: an extra one (a QK norm, an
  // attention output bias, rope_freqs...) would change the model's output.
  std::set<std::string> used = {"token_embd.weight", "output_norm.weight", "output.weight"};
  for (int l = 0; l < c.layers; ++l) {
    for (const char* t :
         {"attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
          "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
          "ffn_down.weight", "attn_q.bias", "attn_k.bias", "attn_v.bias"}) {
      used.insert(absl::StrCat("blk.", l, ".", t));
    }
  }
  for (const auto& t : f.tensors()) {
    if (!used.count(t.name)) {
      return absl::UnimplementedError(absl::StrCat("model: tensor ", t.name, " (", arch,
                                                   ") is not supported by the forward pass"));
    }
  }
  const int64_t H = c.hidden, D = c.head_dim, KV = c.kv_heads * D;
  ASSIGN_OR_RETURN(m->tok_embd_, kvq::frontend::Load(f, "token_embd.weight", {H, c.vocab}));
  ASSIGN_OR_RETURN(m->out_norm_, kvq::frontend::Load(f, "output_norm.weight", {H}));
  if (f.FindTensor("output.weight")) {
    ASSIGN_OR_RETURN(m->output_, kvq::frontend::Load(f, "output.weight", {H, c.vocab}));
  }
  m->layers_.resize(c.layers);
  for (int l = 0; l < c.layers; ++l) {
    Layer& L = m->layers_[l];
    const std::string p = absl::StrCat("blk.", l, ".");
    ASSIGN_OR_RETURN(L.attn_norm, kvq::frontend::Load(f, p + "attn_norm.weight", {H}));
    ASSIGN_OR_RETURN(L.wq, kvq::frontend::Load(f, p + "attn_q.weight", {H, H}));
    ASSIGN_OR_RETURN(L.wk, kvq::frontend::Load(f, p + "attn_k.weight", {H, KV}));
    ASSIGN_OR_RETURN(L.wv, kvq::frontend::Load(f, p + "attn_v.weight", {H, KV}));
    ASSIGN_OR_RETURN(L.wo, kvq::frontend::Load(f, p + "attn_output.weight", {H, H}));
    ASSIGN_OR_RETURN(L.ffn_norm, kvq::frontend::Load(f, p + "ffn_norm.weight", {H}));
    ASSIGN_OR_RETURN(L.wgate, kvq::frontend::Load(f, p + "ffn_gate.weight", {H, c.ffn}));
    ASSIGN_OR_RETURN(L.wup, kvq::frontend::Load(f, p + "ffn_up.weight", {H, c.ffn}));
    ASSIGN_OR_RETURN(L.wdown, kvq::frontend::Load(f, p + "ffn_down.weight", {c.ffn, H}));
    // Projection biases (qwen2 has them; a llama file may too).
    struct Bias {
      const char* name;
      int64_t n;
      std::vector<float>* dst;
    };
    for (Bias b : {Bias{"attn_q.bias", H, &L.bq}, Bias{"attn_k.bias", KV, &L.bk},
                   Bias{"attn_v.bias", KV, &L.bv}}) {
      if (f.FindTensor(p + b.name)) {
        ASSIGN_OR_RETURN(*b.dst, kvq::frontend::Load(f, p + b.name, {b.n}));
      }
    }
    if (arch == "qwen2" && (L.bq.empty() || L.bk.empty() || L.bv.empty())) {
      return absl::InvalidArgumentError(
          absl::StrCat("model: qwen2 layer ", l, " lacks a Q/K/V bias"));
    }
  }
  // RoPE frequencies, theta_i = pos * base^(-2i/n) for pair i (either layout).
  for (int i = 0; i < c.rope_dims / 2; ++i) {
    m->inv_freq_.push_back(
        static_cast<float>(std::pow(static_cast<double>(c.rope_base), -2.0 * i / c.rope_dims)));
  }
  return m;
}

std::vector<float> LlamaModel::OutputProjectionMetric(bool heads_together) const {
  const int H = cfg_.hidden, D = cfg_.head_dim, group = cfg_.q_heads / cfg_.kv_heads;
  const int in = cfg_.q_heads * D;  // wo's row length
  std::vector<float> out(static_cast<size_t>(cfg_.layers) * cfg_.kv_heads * D * D);
  std::vector<float> sum(static_cast<size_t>(H) * D);
  for (int l = 0; l < cfg_.layers; ++l) {
    // wo is [hidden][q_heads * D] row-major (y = wo attn): query head q's columns are
    // q*D .. q*D + D-1, and the group of KV head h is query heads h*group .. (h+1)*group-1
    // (as attention maps them), so M_h sums the Gram matrices of `group` column blocks.
    const float* wo = layers_[l].wo.data();
    for (int h = 0; h < cfg_.kv_heads; ++h) {
      float* m = out.data() + (static_cast<size_t>(l) * cfg_.kv_heads + h) * D * D;
      if (heads_together) {  // the group's column blocks summed, then one Gram matrix
        std::fill(sum.begin(), sum.end(), 0.0f);
        for (int q = h * group; q < (h + 1) * group; ++q)
          for (int i = 0; i < H; ++i)
            for (int c = 0; c < D; ++c)
              sum[i * D + c] += wo[static_cast<size_t>(i) * in + q * D + c];
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, D, D, H, 1.0f, sum.data(), D,
                    sum.data(), D, 0.0f, m, D);
      } else {
        for (int q = h * group; q < (h + 1) * group; ++q)
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, D, D, H, 1.0f, wo + q * D, in,
                      wo + q * D, in, 1.0f, m, D);
      }
      // Exactly symmetric (the product's two triangles may round differently).
      for (int a = 0; a < D; ++a)
        for (int b = a + 1; b < D; ++b)
          m[a * D + b] = m[b * D + a] = 0.5f * (m[a * D + b] + m[b * D + a]);
    }
  }
  return out;
}

absl::Status LlamaModel::Forward(const int32_t* tokens, int n, int64_t start, AttentionCache* cache,
                                 int logits_from, std::vector<float>* logits,
                                 const ActivationHook& hook) const {
  std::vector<std::vector<float>> out;
  RETURN_IF_ERROR(
      ForwardBatch({tokens}, n, start, {cache}, logits_from, logits ? &out : nullptr, hook));
  if (logits) *logits = std::move(out[0]);
  return absl::OkStatus();
}

absl::Status LlamaModel::ForwardBatch(const std::vector<const int32_t*>& tokens, int n,
                                      int64_t start, const std::vector<AttentionCache*>& caches,
                                      int logits_from, std::vector<std::vector<float>>* logits,
                                      const ActivationHook& hook) const {
  const LlamaConfig& c = cfg_;
  const int H = c.hidden, D = c.head_dim, QH = c.q_heads, KVH = c.kv_heads, F = c.ffn;
  const int S = static_cast<int>(tokens.size());
  if (caches.size() != tokens.size() || S == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ForwardBatch: ", S, " token rows for ", caches.size(), " caches"));
  }
  if (logits) logits->assign(S, {});
  if (n <= 0) return absl::OkStatus();
  // Rows r = s * n + i: token i of sequence s. The products run on all S * n rows at once.
  const int rows = S * n;
  std::vector<float> x(static_cast<size_t>(rows) * H), h(x.size()), q(x.size()), qt(x.size()),
      att(x.size()), attt(x.size());
  std::vector<float> k(static_cast<size_t>(rows) * KVH * D), v(k.size());
  std::vector<float> g(static_cast<size_t>(rows) * F), u(g.size());
  for (int s = 0; s < S; ++s) {
    for (int i = 0; i < n; ++i) {
      const int32_t t = tokens[s][i];
      if (t < 0 || t >= c.vocab) {
        return absl::InvalidArgumentError(absl::StrCat("token id ", t, " out of range"));
      }
      std::copy_n(tok_embd_.data() + static_cast<size_t>(t) * H, H,
                  x.data() + (static_cast<size_t>(s) * n + i) * H);
    }
  }
  // cos/sin per (token, pair); every sequence has the same positions.
  const int P = c.rope_dims / 2;
  std::vector<float> cs, sn;
  RopeAngles(rope(), start, n, &cs, &sn);
  const bool halves = c.rope_layout == RopeLayout::kHalves;
  auto rotate = [&](float* row, int heads) {  // row: [rows][heads][D]
    for (int r = 0; r < rows; ++r) {
      const int i = r % n;
      for (int hh = 0; hh < heads; ++hh) {
        RotatePairs(row + (static_cast<size_t>(r) * heads + hh) * D,
                    cs.data() + static_cast<size_t>(i) * P, sn.data() + static_cast<size_t>(i) * P,
                    P, halves, /*inverse=*/false);
      }
    }
  };
  const size_t qs = static_cast<size_t>(n) * QH * D, ks = static_cast<size_t>(n) * KVH * D;
  for (int l = 0; l < c.layers; ++l) {
    const Layer& L = layers_[l];
    RmsNorm(x.data(), L.attn_norm.data(), rows, H, c.rms_eps, h.data());
    MatMulEach(h.data(), L.wq, S, n, H, H, q.data());
    MatMulEach(h.data(), L.wk, S, n, H, KVH * D, k.data());
    MatMulEach(h.data(), L.wv, S, n, H, KVH * D, v.data());
    AddBias(L.bq, rows, q.data());
    AddBias(L.bk, rows, k.data());
    AddBias(L.bv, rows, v.data());
    rotate(q.data(), QH);
    rotate(k.data(), KVH);
    for (int s = 0; s < S; ++s) {
      // Sequence s: [n][QH][D] -> [QH][n][D], its own cache, and back.
      const float* qs_in = q.data() + s * qs;
      float* qts = qt.data() + s * qs;
      for (int i = 0; i < n; ++i)
        for (int hh = 0; hh < QH; ++hh)
          std::copy_n(qs_in + (static_cast<size_t>(i) * QH + hh) * D, D,
                      qts + (static_cast<size_t>(hh) * n + i) * D);
      if (hook) hook(l, start, n, qts, k.data() + s * ks, v.data() + s * ks);
      float* as = att.data() + s * qs;
      RETURN_IF_ERROR(
          caches[s]->AppendAndAttend(l, k.data() + s * ks, v.data() + s * ks, start, n, qts, as));
      float* atts = attt.data() + s * qs;
      for (int hh = 0; hh < QH; ++hh)
        for (int i = 0; i < n; ++i)
          std::copy_n(as + (static_cast<size_t>(hh) * n + i) * D, D,
                      atts + (static_cast<size_t>(i) * QH + hh) * D);
    }
    MatMulEach(attt.data(), L.wo, S, n, H, H, x.data(), 1.0f);  // x += attn Wo^T
    RmsNorm(x.data(), L.ffn_norm.data(), rows, H, c.rms_eps, h.data());
    MatMulEach(h.data(), L.wgate, S, n, H, F, g.data());
    MatMulEach(h.data(), L.wup, S, n, H, F, u.data());
    for (size_t i = 0; i < g.size(); ++i) {
      const float a = g[i];
      g[i] = a / (1.0f + std::exp(-a)) * u[i];
    }
    MatMulEach(g.data(), L.wdown, S, n, F, H, x.data(), 1.0f);
  }
  if (logits && logits_from < n) {
    // The last m rows of every sequence, gathered so the output matrix is read once.
    const int m = n - std::max(0, logits_from);
    for (int s = 0; s < S; ++s) {
      RmsNorm(x.data() + (static_cast<size_t>(s) * n + (n - m)) * H, out_norm_.data(), m, H,
              c.rms_eps, h.data() + static_cast<size_t>(s) * m * H);
    }
    const size_t per = static_cast<size_t>(m) * c.vocab;
    std::vector<float> all;
    std::vector<float>* dst = S == 1 ? &(*logits)[0] : &all;
    dst->resize(per * S);
    MatMulEach(h.data(), output_.empty() ? tok_embd_ : output_, S, m, H, c.vocab, dst->data());
    for (int s = 0; S > 1 && s < S; ++s) {
      (*logits)[s].assign(all.begin() + s * per, all.begin() + (s + 1) * per);
    }
  }
  return absl::OkStatus();
}

absl::Status LlamaModel::ForwardDecodeFaithful(const int32_t* tokens, int n, int64_t start,
                                               AttentionCache* cache, int logits_from,
                                               std::vector<float>* logits, int max_chunk,
                                               const ActivationHook& hook) const {
  std::vector<std::vector<float>> out;
  RETURN_IF_ERROR(ForwardDecodeFaithfulBatch({tokens}, n, start, {cache}, logits_from,
                                             logits ? &out : nullptr, max_chunk, hook));
  if (logits) *logits = std::move(out[0]);
  return absl::OkStatus();
}

absl::Status LlamaModel::ForwardDecodeFaithfulBatch(
    const std::vector<const int32_t*>& tokens, int n, int64_t start,
    const std::vector<AttentionCache*>& caches, int logits_from,
    std::vector<std::vector<float>>* logits, int max_chunk, const ActivationHook& hook) const {
  const size_t S = tokens.size();
  if (caches.size() != S || S == 0) {
    return absl::InvalidArgumentError(absl::StrCat("ForwardDecodeFaithfulBatch: ", S,
                                                   " token rows for ", caches.size(), " caches"));
  }
  if (logits) logits->assign(S, {});
  std::vector<std::vector<float>> part;
  std::vector<const int32_t*> at(S);
  int done = 0;
  while (done < n) {
    const int64_t pos = start + done;
    int len = std::min(max_chunk, n - done);
    // The query at position p sees the cache after its own token is appended (count p + 1).
    // An append that brings the count to B encodes a group, so every query of a chunk must lie
    // on the same side of B: the chunk stops at count B - 1, and the next one starts with the
    // token whose append triggers the encode.
    int64_t b = caches[0]->NextEncodeBoundary(pos);
    for (size_t s = 1; s < S; ++s) {
      if (caches[s]->NextEncodeBoundary(pos) != b) {
        return absl::InvalidArgumentError(
            "ForwardDecodeFaithfulBatch: the caches encode at different positions");
      }
    }
    if (b >= 0) {
      const int64_t g = caches[0]->EncodeGroup();
      if (b <= pos + 1) b += g;
      if (b - 1 - pos < len) len = static_cast<int>(b - 1 - pos);
    }
    const int lf = std::max(0, logits_from - done);
    for (size_t s = 0; s < S; ++s) at[s] = tokens[s] + done;
    RETURN_IF_ERROR(ForwardBatch(at, len, pos, caches, lf, logits ? &part : nullptr, hook));
    for (size_t s = 0; logits && s < S; ++s) {
      (*logits)[s].insert((*logits)[s].end(), part[s].begin(), part[s].end());
    }
    done += len;
  }
  return absl::OkStatus();
}

}  // namespace kvq::frontend
