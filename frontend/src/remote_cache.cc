#include "kvq/frontend/remote_cache.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvq/core/status.h"
#include "kvq/core/tensor.h"
#include "kvq/format/block_format.h"
#include "kvq/wire/codec_settings.h"
#include "kvq/wire/model.h"

namespace kvq::frontend {
namespace {

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void SetShape(v1::Tensor* t, v1::DType dt, std::initializer_list<int64_t> shape) {
  t->set_dtype(dt);
  t->clear_shape();
  for (int64_t s : shape) t->add_shape(s);
}

absl::Status ItemError(const v1::ItemStatus& s, const std::string& what) {
  if (s.code() == 0) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.code()),
                      absl::StrCat(what, ": ", s.message()));
}

}  // namespace

absl::StatusOr<RemoteModel> RegisterRemoteModel(client::Client& client, const CacheShape& s,
                                                const core::ModelBasis* basis,
                                                const std::string& name, bool codes) {
  v1::RegisterBasisRequest req;
  v1::ModelInfo* info = req.mutable_info();
  info->set_layers(s.layers);
  info->set_kv_heads(s.kv_heads);
  info->set_q_heads(s.q_heads);
  info->set_head_dim(s.head_dim);
  if (basis) {
    const core::BasisManifest& m = basis->manifest;
    if (m.layers != s.layers || m.kv_heads != s.kv_heads || m.head_dim != s.head_dim) {
      return absl::InvalidArgumentError(absl::StrCat("basis shape (layers ", m.layers,
                                                     ", kv_heads ", m.kv_heads, ", head_dim ",
                                                     m.head_dim, ") does not fit the model"));
    }
    wire::BasisToWire(*basis, &req);
    info->set_model(name.empty() ? m.model : name);
    info->set_version(std::max(1, m.version));
    info->set_q_heads(s.q_heads);
  } else {
    info->set_model(name.empty()
                        ? absl::StrCat("kvq-frontend-", s.layers, "x", s.kv_heads, "x", s.head_dim)
                        : name);
    info->set_version(1);
    info->set_basis_rank(0);
  }
  ASSIGN_OR_RETURN(v1::RegisterBasisResponse resp, client.RegisterBasis(req));
  RemoteModel out{resp.model().model(), resp.model().version()};
  const v1::ModelInfo& got = resp.model();
  if (!codes) {
    out.rows_reason = "codes on the wire not asked for";
  } else if (got.block_version_max() < format::kMinVersion ||
             got.block_version_min() > format::kMaxVersion) {
    out.rows_reason =
        absl::StrCat("the server takes block-format versions ", got.block_version_min(), " to ",
                     got.block_version_max(), "; this client ", format::kMinVersion, " to ",
                     format::kMaxVersion);
  } else {
    ASSIGN_OR_RETURN(v1::RegisterBasisRequest b, client.GetBasis(out.model, out.version));
    ASSIGN_OR_RETURN(out.codes, client::ModelCodes::Create(b));
  }
  return out;
}

// ------------------------------------------------------------------------------ batcher

RemoteStats RemoteBatcher::stats() const {
  std::lock_guard<std::mutex> l(mu_);
  return stats_;
}

void RemoteBatcher::RecordAttach(double seconds, int64_t bytes, int64_t tokens_attached) {
  std::lock_guard<std::mutex> l(mu_);
  stats_.put_seconds += seconds;
  stats_.bytes_sent += bytes;
  ++stats_.attach_rpcs;
  stats_.tokens_attached += tokens_attached;
}

void RemoteBatcher::Join() {
  std::lock_guard<std::mutex> l(mu_);
  ++active_;
}

void RemoteBatcher::Leave() {
  std::lock_guard<std::mutex> l(mu_);
  --active_;
  // The others may all be parked, waiting for this one.
  if (!pending_.empty() && static_cast<int>(pending_.size()) >= active_) FlushLocked();
}

absl::Status RemoteBatcher::Run(Request* r) {
  std::unique_lock<std::mutex> l(mu_);
  pending_.push_back(r);
  if (static_cast<int>(pending_.size()) >= active_) {
    FlushLocked();
    return r->status;
  }
  const uint64_t gen = generation_;
  cv_.wait(l, [&] { return generation_ != gen; });
  return r->status;
}

// Runs with mu_ held: every other participant is parked in Run (or about to Leave), so no
// one can add to this batch meanwhile.
void RemoteBatcher::FlushLocked() {
  std::vector<Request*> batch;
  batch.swap(pending_);
  // Appends go with their Attend or Score item (AttendItem.append, ScoreItem.append): one
  // round trip per step and layer.
  auto t0 = std::chrono::steady_clock::now();
  ++stats_.batches;
  stats_.items += static_cast<int64_t>(batch.size());
  {
    v1::AttendRequest areq;
    v1::ScoreRequest sreq;
    std::vector<Request*> att, sco;
    for (Request* r : batch) {
      if (r->score) {
        v1::ScoreItem* item = sreq.add_items();
        *item = std::move(r->score_item);
        if (r->has_append) {
          *item->mutable_append() = std::move(r->append);
          ++stats_.appends_in_attend;
        }
        sco.push_back(r);
      } else {
        v1::AttendItem* item = areq.add_items();
        *item = std::move(r->attend);
        if (r->has_append) {
          *item->mutable_append() = std::move(r->append);
          ++stats_.appends_in_attend;
          stats_.appends_in_codes += r->codes;
        }
        att.push_back(r);
      }
    }
    if (!att.empty()) {
      stats_.bytes_sent += static_cast<int64_t>(areq.ByteSizeLong());
      t0 = std::chrono::steady_clock::now();
      absl::StatusOr<v1::AttendResponse> ar = client_->Attend(areq);
      stats_.read_seconds += Since(t0);
      ++stats_.attend_rpcs;
      for (size_t i = 0; i < att.size(); ++i) {
        if (!ar.ok()) {
          att[i]->status =
              absl::Status(ar.status().code(), absl::StrCat("Attend: ", ar.status().message()));
        } else if (i >= static_cast<size_t>(ar->results_size())) {
          att[i]->status = absl::InternalError("Attend: missing result");
        } else {
          v1::AttendResult* res = ar->mutable_results(static_cast<int>(i));
          att[i]->status = ItemError(res->status(), "Attend");
          att[i]->result = std::move(*res->mutable_outputs());
        }
      }
    }
    if (!sco.empty()) {
      stats_.bytes_sent += static_cast<int64_t>(sreq.ByteSizeLong());
      t0 = std::chrono::steady_clock::now();
      absl::StatusOr<v1::ScoreResponse> sr = client_->Score(sreq);
      stats_.read_seconds += Since(t0);
      ++stats_.score_rpcs;
      for (size_t i = 0; i < sco.size(); ++i) {
        if (!sr.ok()) {
          sco[i]->status =
              absl::Status(sr.status().code(), absl::StrCat("Score: ", sr.status().message()));
        } else if (i >= static_cast<size_t>(sr->results_size())) {
          sco[i]->status = absl::InternalError("Score: missing result");
        } else {
          v1::ScoreResult* res = sr->mutable_results(static_cast<int>(i));
          sco[i]->status = ItemError(res->status(), "Score");
          sco[i]->result = std::move(*res->mutable_logits());
        }
      }
    }
  }
  ++generation_;
  cv_.notify_all();
}

// -------------------------------------------------------------------------------- cache

absl::StatusOr<std::unique_ptr<RemoteCache>> RemoteCache::Create(client::Client* client,
                                                                 RemoteBatcher* batcher,
                                                                 const CacheShape& shape,
                                                                 Options options) {
  if (!client) return absl::InvalidArgumentError("remote cache: no client");
  if (options.sequence_id.empty())
    return absl::InvalidArgumentError("remote cache: no sequence id");
  if (options.codec.head_dim != shape.head_dim) {
    return absl::InvalidArgumentError("remote cache: codec head_dim != model head_dim");
  }
  ASSIGN_OR_RETURN(v1::CodecSettings wire, wire::CodecToWire(options.codec));
  std::unique_ptr<RemoteCache> c(new RemoteCache(client, batcher, shape, std::move(options)));
  c->wire_codec_ = std::move(wire);
  if (!c->batcher_) {
    c->own_batcher_ = std::make_unique<RemoteBatcher>(client);
    c->batcher_ = c->own_batcher_.get();
  }
  c->tokens_.assign(shape.layers, 0);
  if (c->o_.keys_only) c->dense_v_.resize(shape.layers);
  c->encode_ =
      c->o_.codes && c->o_.model.codes && !c->o_.keys_only && !c->o_.codec.per_token_value_bits();
  c->encoders_.resize(shape.layers);
  c->batcher_->Join();
  c->joined_ = true;
  return c;
}

RemoteCache::~RemoteCache() { Finish(/*delete_sequence=*/false).IgnoreError(); }

absl::Status RemoteCache::Finish(bool delete_sequence) {
  if (joined_) {
    joined_ = false;
    batcher_->Leave();
  }
  if (!delete_sequence || finished_) return absl::OkStatus();
  finished_ = true;
  if (!created_) return absl::OkStatus();
  absl::Status st = client_->DeleteSequence(o_.sequence_id).status();
  // A first append that failed may have created nothing.
  return st.code() == absl::StatusCode::kNotFound ? absl::OkStatus() : st;
}

void RemoteCache::SetTokenIds(const int32_t* ids, int64_t n) {
  ids_.clear();
  AddTokenIds(ids, n);
}

void RemoteCache::AddTokenIds(const int32_t* ids, int64_t n) {
  ids_.insert(ids_.end(), ids, ids + n);  // int32 -> uint32: the wire's type, same bits
}

absl::StatusOr<int64_t> RemoteCache::AttachPrefix(int64_t max_tokens) {
  if (!o_.share) return absl::FailedPreconditionError("remote cache: attach needs share");
  if (o_.keys_only) {
    return absl::FailedPreconditionError(
        "remote cache: a keys-only configuration keeps its values in the frontend, and an "
        "attach brings none");
  }
  for (int64_t t : tokens_) {
    if (t != 0)
      return absl::FailedPreconditionError("remote cache: attach only to an empty sequence");
  }
  const int64_t G = o_.codec.key_group;
  int64_t limit = max_tokens < 0 ? token_ids_given() : std::min(max_tokens, token_ids_given());
  for (;;) {
    const int64_t want = limit / G * G;
    if (want == 0) return 0;
    v1::PutBlocksRequest m;
    for (int l = 0; l < s_.layers; ++l) {
      v1::Append* a = m.add_appends();
      a->set_sequence_id(o_.sequence_id);
      a->set_layer(l);
      a->set_start(0);
      a->set_model(o_.model.model);
      a->set_basis_version(o_.model.version);
      *a->mutable_codec() = wire_codec_;
      a->mutable_token_ids()->Add(ids_.begin(), ids_.begin() + want);
    }
    const auto t0 = std::chrono::steady_clock::now();
    created_ = true;
    absl::StatusOr<v1::PutBlocksResponse> r = client_->PutBlocks({m});
    if (!r.ok()) {
      return absl::Status(r.status().code(),
                          absl::StrCat("PutBlocks (attach): ", r.status().message()));
    }
    std::vector<int64_t> got(s_.layers, 0);
    for (const auto& len : r->lengths()) {
      if (len.sequence_id() == o_.sequence_id && len.layer() >= 0 && len.layer() < s_.layers)
        got[len.layer()] = len.tokens();
    }
    const auto [lo, hi] = std::minmax_element(got.begin(), got.end());
    batcher_->RecordAttach(Since(t0), static_cast<int64_t>(m.ByteSizeLong()), *lo == *hi ? *lo : 0);
    if (*lo == *hi) {
      tokens_.assign(s_.layers, *lo);
      return *lo;
    }
    // Layers disagree: start over, asking for no more than the shortest got.
    RETURN_IF_ERROR(client_->DeleteSequence(o_.sequence_id).status());
    created_ = false;
    limit = *lo;
  }
}

absl::Status RemoteCache::Encode(int layer, int64_t at, int m, RemoteBatcher::Request* req) {
  std::unique_ptr<client::LayerEncoder>& enc = encoders_[layer];
  if (encode_ && at == 0) {
    ASSIGN_OR_RETURN(enc, o_.model.codes->Encoder(layer, o_.codec));
  }
  if (!enc) return absl::OkStatus();
  if (enc->tokens() != at) {  // rows reached the server some other way: rows from now on
    enc.reset();
    return absl::OkStatus();
  }
  v1::Append& a = req->append;
  // Views of the fp16 rows the append carries; Append reads them before it rewrites `a`.
  const core::TensorView k = core::TensorView::Contiguous(a.keys().data().data(), core::DType::kF16,
                                                          {s_.kv_heads, m, s_.head_dim});
  const core::TensorView v = core::TensorView::Contiguous(
      a.values().data().data(), core::DType::kF16, {s_.kv_heads, m, s_.head_dim});
  absl::StatusOr<bool> coded = enc->Append(k, v, &a);
  if (!coded.ok()) {
    enc.reset();
    return absl::Status(coded.status().code(), absl::StrCat("remote cache: encoding layer ", layer,
                                                            ": ", coded.status().message()));
  }
  req->codes = *coded;
  return absl::OkStatus();
}

int64_t RemoteCache::NextEncodeBoundary(int64_t tokens) const {
  const int64_t G = o_.codec.key_group, R = o_.codec.window;
  const int64_t encoded = tokens >= R + G ? (tokens - R) / G * G : 0;
  return encoded + R + G;
}

absl::Status RemoteCache::AppendAndAttend(int layer, const float* k, const float* v, int64_t start,
                                          int n, const float* q, float* out) {
  if (!joined_) return absl::FailedPreconditionError("remote cache: finished");
  if (layer < 0 || layer >= s_.layers) return absl::InvalidArgumentError("remote cache: bad layer");
  // Rows the layer already holds (attached from the prefix index, see AttachPrefix) are not
  // sent again; their queries still attend.
  const int64_t held = tokens_[layer] - start;
  if (held < 0 || (held > 0 && o_.keys_only)) {
    return absl::InvalidArgumentError(absl::StrCat("remote cache: append at ", start, " but layer ",
                                                   layer, " holds ", tokens_[layer]));
  }
  const int skip = static_cast<int>(std::min<int64_t>(held, n));
  const int m = n - skip;  // rows sent
  const int64_t at = start + skip;
  const int KVH = s_.kv_heads, D = s_.head_dim, QH = s_.q_heads;
  RemoteBatcher::Request req;
  req.has_append = m > 0;
  v1::Append& a = req.append;
  if (o_.share && at + m > token_ids_given()) {
    return absl::FailedPreconditionError(
        absl::StrCat("remote cache: share needs the token ids of tokens [", at, ", ", at + m, "); ",
                     token_ids_given(), " given (SetTokenIds)"));
  }
  const size_t cnt = static_cast<size_t>(m) * KVH * D;
  if (m > 0) {
    a.set_sequence_id(o_.sequence_id);
    a.set_layer(layer);
    a.set_start(at);
    if (at == 0) {  // creates the sequence: pin model, version and codec
      a.set_model(o_.model.model);
      a.set_basis_version(o_.model.version);
      *a.mutable_codec() = wire_codec_;
    }
    // [n][kv][d] fp32 -> [kv][m][d] fp16 (rows skip..n-1), the wire dtype (CodecCache rounds
    // the same way).
    std::vector<float> tr(cnt);
    for (auto [src, t] : {std::pair{k, a.mutable_keys()}, std::pair{v, a.mutable_values()}}) {
      for (int h = 0; h < KVH; ++h)
        for (int i = 0; i < m; ++i)
          std::memcpy(tr.data() + (static_cast<size_t>(h) * m + i) * D,
                      src + (static_cast<size_t>(skip + i) * KVH + h) * D, D * sizeof(float));
      SetShape(t, v1::DTYPE_F16, {KVH, m, D});
      std::string* bytes = t->mutable_data();
      bytes->resize(cnt * 2);
      core::FromFloat(core::DType::kF16, tr.data(), bytes->data(), cnt);
    }
    RETURN_IF_ERROR(Encode(layer, at, m, &req));
    if (o_.share) {
      a.mutable_token_ids()->Add(ids_.begin() + a.start(), ids_.begin() + at + m);
    }
  }
  const size_t qbytes = static_cast<size_t>(QH) * n * D * sizeof(float);
  if (o_.keys_only) {
    req.score = true;
    v1::ScoreItem& it = req.score_item;
    it.set_sequence_id(o_.sequence_id);
    it.set_layer(layer);
    it.set_basis_version(o_.model.version);
    SetShape(it.mutable_queries(), v1::DTYPE_F32, {QH, n, D});
    it.mutable_queries()->set_data(reinterpret_cast<const char*>(q), qbytes);
    // Values stay here at fp16, as CodecCache's keys-only path keeps them.
    auto& dv = dense_v_[layer];
    const size_t old = dv.size();
    dv.resize(old + cnt);
    std::vector<uint16_t> h16(cnt);
    core::FromFloat(core::DType::kF16, v, h16.data(), cnt);
    core::ToFloat(core::DType::kF16, h16.data(), dv.data() + old, cnt);
  } else {
    v1::AttendItem& it = req.attend;
    it.set_sequence_id(o_.sequence_id);
    it.set_layer(layer);
    it.set_basis_version(o_.model.version);
    SetShape(it.mutable_queries(), v1::DTYPE_F32, {QH, n, D});
    it.mutable_queries()->set_data(reinterpret_cast<const char*>(q), qbytes);
    it.set_causal_offset(start);
    // Only the A^2 policy uses what attends observe; read-only calls are also retryable.
    it.set_observe(o_.codec.per_token_value_bits());
    it.set_output_dtype(v1::DTYPE_F32);
  }
  created_ = true;
  absl::Status st = batcher_->Run(&req);
  if (!st.ok()) {
    if (o_.keys_only) dense_v_[layer].resize(dense_v_[layer].size() - cnt);
    encoders_[layer].reset();  // the server may not hold what the encoder took
    return st;
  }
  tokens_[layer] = std::max(tokens_[layer], start + n);
  const int64_t T = tokens_[layer];
  const v1::Tensor& r = req.result;
  if (!o_.keys_only) {
    if (r.dtype() != v1::DTYPE_F32 || r.data().size() != qbytes) {
      return absl::InternalError(
          absl::StrCat("Attend: outputs of ", r.data().size(), " bytes, expected ", qbytes));
    }
    std::memcpy(out, r.data().data(), qbytes);
    return absl::OkStatus();
  }
  const size_t lbytes = static_cast<size_t>(QH) * n * T * sizeof(float);
  if (r.dtype() != v1::DTYPE_F32 || r.data().size() != lbytes) {
    return absl::InternalError(absl::StrCat("Score: logits of ", r.data().size(),
                                            " bytes, expected ", lbytes, " (", T, " tokens)"));
  }
  // Causal softmax of the server's logits, readout over the fp16 values held here.
  std::vector<float> p(static_cast<size_t>(T));
  const float* logits = reinterpret_cast<const float*>(r.data().data());
  const float* V = dense_v_[layer].data();
  const int group = QH / KVH;
  for (int h = 0; h < QH; ++h) {
    const int kh = h / group;
    for (int i = 0; i < n; ++i) {
      const float* li = logits + (static_cast<size_t>(h) * n + i) * T;
      const int64_t vis = std::min<int64_t>(T, start + i + 1);
      float mx = -INFINITY;
      for (int64_t t = 0; t < vis; ++t) mx = std::max(mx, li[t]);
      double sum = 0;
      for (int64_t t = 0; t < vis; ++t) {
        p[t] = std::exp(li[t] - mx);
        sum += p[t];
      }
      const float inv = static_cast<float>(1.0 / sum);
      float* o = out + (static_cast<size_t>(h) * n + i) * D;
      std::fill(o, o + D, 0.0f);
      for (int64_t t = 0; t < vis; ++t) {
        const float w = p[t] * inv;
        const float* vt = V + (static_cast<size_t>(t) * KVH + kh) * D;
        for (int c = 0; c < D; ++c) o[c] += w * vt[c];
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvq::frontend
