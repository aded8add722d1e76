#include "server/service.h"

#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kvq/core/field_error.h"
#include "kvq/core/status.h"
#include "kvq/format/block_format.h"
#include "kvq/wire/codec_settings.h"
#include "kvq/wire/encoded_groups.h"
#include "kvq/wire/model.h"
#include "kvq/wire/tensor.h"
#include "server/convert.h"

namespace kvq::server {
namespace {

absl::Status CheckId(const std::string& id, absl::string_view field) {
  if (id.empty() || id.size() > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be 1..256 bytes (got ", id.size(), ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckBatch(int n) {
  if (n < 1 || n > kMaxBatchItems) {
    return absl::InvalidArgumentError(
        absl::StrCat("items holds ", n, " entries; expected 1..", kMaxBatchItems));
  }
  return absl::OkStatus();
}

absl::Status Prefix(const absl::Status& st, absl::string_view prefix) {
  if (st.ok()) return st;
  return absl::Status(st.code(), absl::StrCat(prefix, ": ", st.message()));
}

}  // namespace

Service::Service(core::Store* store, core::Registry* registry, core::WorkerPool* pool,
                 CallGate::Options calls, std::string pool_name, std::string backend_name)
    : store_(store),
      registry_(registry),
      auth_(calls.auth),
      pool_(pool),
      pool_name_(std::move(pool_name)),
      backend_name_(std::move(backend_name)),
      started_(absl::Now()),
      calls_(calls) {}

template <typename Req, typename Resp, typename Body>
grpc::ServerUnaryReactor* Service::Unary(const char* method, CallKind kind,
                                         grpc::CallbackServerContext* ctx, const Req* req,
                                         Resp* resp, Body body) {
  return server::Unary(&calls_, pool_, method, kind, ctx, req, resp, std::move(body));
}

// ---------------------------------------------------------------------------- registry

grpc::ServerUnaryReactor* Service::RegisterBasis(grpc::CallbackServerContext* ctx,
                                                 const v1::RegisterBasisRequest* req,
                                                 v1::RegisterBasisResponse* resp) {
  return Unary(
      "RegisterBasis", CallKind::kPooled, ctx, req, resp, [this, req, resp](const Call& call) {
        const std::string& tenant = call.tenant();
        if (!auth_->MayRegister(tenant)) {
          return absl::PermissionDeniedError(
              absl::StrCat("tenant '", tenant, "' may not register models (see --admin-tenants)"));
        }
        ASSIGN_OR_RETURN(core::ModelEntry e, wire::ModelFromWire(*req));
        bool already = false;
        ASSIGN_OR_RETURN(std::shared_ptr<const core::ModelEntry> stored,
                         registry_->Register(std::move(e), &already));
        wire::ModelToWire(*stored,
                          store_->LiveSequences(stored->manifest.model, stored->manifest.version),
                          resp->mutable_model());
        resp->set_already_registered(already);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* Service::ListModels(grpc::CallbackServerContext* ctx,
                                              const v1::ListModelsRequest* req,
                                              v1::ListModelsResponse* resp) {
  return Unary("ListModels", CallKind::kInline, ctx, req, resp, [this, resp](const Call&) {
    for (const auto& e : registry_->List()) {
      wire::ModelToWire(*e, store_->LiveSequences(e->manifest.model, e->manifest.version),
                        resp->add_models());
    }
    return absl::OkStatus();
  });
}

namespace {

// The registry entry a GetModel or GetBasis request names (version 0: the latest).
absl::StatusOr<std::shared_ptr<const core::ModelEntry>> ModelNamed(core::Registry& registry,
                                                                   const v1::GetModelRequest& req) {
  if (req.model().empty()) return absl::InvalidArgumentError("model must be set");
  if (req.version() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("version ", req.version(), " must be >= 0 (0: latest)"));
  }
  return registry.Get(req.model(), req.version());
}

}  // namespace

grpc::ServerUnaryReactor* Service::GetModel(grpc::CallbackServerContext* ctx,
                                            const v1::GetModelRequest* req, v1::ModelInfo* resp) {
  return Unary("GetModel", CallKind::kInline, ctx, req, resp, [this, req, resp](const Call&) {
    ASSIGN_OR_RETURN(std::shared_ptr<const core::ModelEntry> e, ModelNamed(*registry_, *req));
    wire::ModelToWire(*e, store_->LiveSequences(e->manifest.model, e->manifest.version), resp);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* Service::GetBasis(grpc::CallbackServerContext* ctx,
                                            const v1::GetModelRequest* req,
                                            v1::RegisterBasisRequest* resp) {
  return Unary("GetBasis", CallKind::kPooled, ctx, req, resp, [this, req, resp](const Call&) {
    ASSIGN_OR_RETURN(std::shared_ptr<const core::ModelEntry> e, ModelNamed(*registry_, *req));
    wire::BasisToWire(e->basis, resp);  // tensors (and info from the basis; the entry wins below)
    wire::ModelToWire(*e, store_->LiveSequences(e->manifest.model, e->manifest.version),
                      resp->mutable_info());
    return absl::OkStatus();
  });
}

// ---------------------------------------------------------------------------- PutBlocks

absl::Status Service::SpecOf(const v1::Append& a, const std::string& at, core::AppendSpec* spec,
                             SpecStorage* storage) {
  core::AppendSpec& s = *spec;
  std::vector<float>* probe = &storage->probe;
  RETURN_IF_ERROR(CheckId(a.sequence_id(), at + ".sequence_id"));
  s.sequence_id = a.sequence_id();
  s.layer = a.layer();
  s.start = a.start();
  if (a.token_ids_size() > 0) {
    s.token_ids = std::span<const uint32_t>(a.token_ids().data(), a.token_ids_size());
  }
  if (a.has_encoded()) {
    core::EncodedGroupsView& run = storage->run;
    RETURN_IF_ERROR(wire::EncodedFromWire(a.encoded(), at + ".encoded", &run));
    s.encoded = &run;
  }
  // keys and values both absent with token ids (an attach from the prefix index) or with
  // encoded groups (no rows after them).
  if ((a.token_ids_size() == 0 && !a.has_encoded()) || a.has_keys() || a.has_values()) {
    ASSIGN_OR_RETURN(s.keys, wire::ViewOf(a.keys(), at + ".keys", 3, 3));
    ASSIGN_OR_RETURN(s.values, wire::ViewOf(a.values(), at + ".values", 3, 3));
  }
  if (a.has_probe_weights()) {
    ASSIGN_OR_RETURN(core::TensorView p,
                     wire::ViewOf(a.probe_weights(), at + ".probe_weights", 2, 2));
    if (p.shape[0] != s.keys.shape[0] || p.shape[1] != s.keys.shape[1]) {
      return absl::InvalidArgumentError(
          absl::StrCat(at, ".probe_weights.shape must be [kv_heads, n] = [", s.keys.shape[0], ", ",
                       s.keys.shape[1], "]"));
    }
    probe->resize(p.numel());
    core::ToFloat(p.dtype, p.data, probe->data(), probe->size());
    s.probe_weights = probe->data();
  }
  s.model = a.model();
  if (a.basis_version() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(at, ".basis_version ", a.basis_version(), " must be >= 0"));
  }
  s.basis_version = a.basis_version();
  if (a.has_codec()) {
    if (a.model().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(at, ".codec is only accepted with model (at creation)"));
    }
    absl::StatusOr<std::shared_ptr<const core::ModelEntry>> m =
        registry_->Get(a.model(), a.basis_version());
    if (!m.ok()) return Prefix(m.status(), at + ".model");
    ASSIGN_OR_RETURN(s.codec, wire::MergeCodec((*m)->codec, a.codec(), at + ".codec"));
    s.has_codec = true;
  }
  return absl::OkStatus();
}

namespace {

// Reading overlaps applying: while a worker parses and encodes message i, message i+1 is
// already being received (at most one received message waits). Messages are applied strictly
// in order, by one worker at a time. The stream is read as raw bytes and parsed here: gRPC's
// typed reader reports a message that does not parse exactly as the client's end of stream,
// which would answer OK and silently drop that message and every later one.
// A stream that waits longer than --stream-idle-timeout for its next message is failed with
// DEADLINE_EXCEEDED (IdleStreams), which frees its --max-inflight slot.
class PutBlocksReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer>, public IdleStream {
 public:
  PutBlocksReactor(Service* svc, grpc::CallbackServerContext* ctx, grpc::ByteBuffer* resp)
      : svc_(svc), resp_(resp), call_(svc->calls(), "PutBlocks", *ctx, CallKind::kPooled) {
    if (!call_.admission().ok()) {
      Done(call_.admission());
      return;
    }
    {
      absl::MutexLock l(&mu_);
      buf_ = std::make_unique<grpc::ByteBuffer>();
      reading_ = true;
    }
    svc_->idle_streams()->Add(this);
    StartRead(buf_.get());
  }

  bool ClaimIdle() override {
    absl::MutexLock l(&mu_);
    if (done_ || applying_ || !queue_.empty()) return false;
    done_ = true;
    return true;
  }

  void ExpireIdle(absl::Duration idle) override {
    const absl::Duration timeout = svc_->idle_streams()->timeout();
    const absl::Duration ms = absl::Trunc(idle, absl::Milliseconds(1));
    Done(absl::DeadlineExceededError(absl::StrCat(
        "PutBlocks stream idle for ", absl::FormatDuration(ms), " (--stream-idle-timeout ",
        absl::FormatDuration(timeout), "); the ", messages_seen_,
        " messages before were applied")));  // may delete this
  }

  void OnReadDone(bool ok) override {
    bool finish = false, submit = false;
    grpc::ByteBuffer* next = nullptr;
    {
      absl::MutexLock l(&mu_);
      reading_ = false;
      if (done_) {  // failed or timed out meanwhile: what arrives now is dropped
        buf_.reset();
        return;
      }
      if (!ok) {  // the client closed its side (or the call was cancelled)
        eof_ = true;
        finish = !applying_ && !done_;
        if (finish) done_ = true;
      } else {
        bytes_in_ += buf_->Length();
        queue_.push_back(std::move(buf_));
        if (!applying_) applying_ = submit = true;
        next = NextReadLocked();
      }
    }
    // The read is started before the drain is scheduled: a drain that fails a message calls
    // Finish, after which no read may be started.
    if (ok) svc_->idle_streams()->Touch(this);
    if (next) StartRead(next);
    if (submit) svc_->pool()->Submit([this] { Drain(); });
    if (finish) Succeed();  // may delete this
  }

  void OnDone() override { delete this; }

 private:
  static constexpr size_t kMaxQueued = 1;  // at most two messages in memory per stream

  // A buffer to read the next message into, when one should be read now.
  grpc::ByteBuffer* NextReadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (reading_ || eof_ || done_ || queue_.size() >= kMaxQueued) return nullptr;
    reading_ = true;
    buf_ = std::make_unique<grpc::ByteBuffer>();
    return buf_.get();
  }

  // Runs on the pool: applies queued messages in order until the queue is empty.
  void Drain() {
    for (;;) {
      std::unique_ptr<grpc::ByteBuffer> msg;
      grpc::ByteBuffer* next = nullptr;
      bool finish = false;
      {
        absl::MutexLock l(&mu_);
        if (queue_.empty()) {
          applying_ = false;
          finish = eof_ && !done_;
          if (finish) done_ = true;
        } else {
          msg = std::move(queue_.front());
          queue_.pop_front();
          next = NextReadLocked();
        }
      }
      if (!msg) {
        if (finish) Succeed();  // may delete this
        return;
      }
      if (next) StartRead(next);
      absl::Status st = ParseAndApply(msg.get());
      svc_->idle_streams()->Touch(this);  // quiet time counts from the end of the work
      if (!st.ok()) {
        {
          absl::MutexLock l(&mu_);
          done_ = true;
          queue_.clear();
        }
        Done(st);  // may delete this
        return;
      }
    }
  }

  void Succeed() {
    for (const auto& [key, tokens] : lengths_) {
      auto* l = out_.add_lengths();
      l->set_sequence_id(key.first);
      l->set_layer(key.second);
      l->set_tokens(tokens);
    }
    Done(absl::OkStatus());
  }

  // Message `messages_seen_` of the stream (0-based). One that does not parse fails the
  // stream; the messages before it were whole and stay applied, as after any failed message.
  absl::Status ParseAndApply(grpc::ByteBuffer* bytes) {
    v1::PutBlocksRequest req;
    const int64_t index = messages_seen_++;
    if (!grpc::SerializationTraits<v1::PutBlocksRequest>::Deserialize(bytes, &req).ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "message ", index, " of the stream (0-based) is not a valid PutBlocksRequest; the ",
          index, " before it were applied"));
    }
    return Apply(req);
  }

  absl::Status Apply(const v1::PutBlocksRequest& req) {
    std::vector<core::AppendSpec> specs(req.appends_size());
    std::vector<Service::SpecStorage> storage(req.appends_size());
    for (int i = 0; i < req.appends_size(); ++i) {
      RETURN_IF_ERROR(
          svc_->SpecOf(req.appends(i), absl::StrCat("appends[", i, "]"), &specs[i], &storage[i]));
    }
    core::AppendOutcome out;
    RETURN_IF_ERROR(svc_->store()->Append(call_.tenant(), specs, &out));
    out_.set_messages(out_.messages() + 1);
    out_.set_appends(out_.appends() + req.appends_size());
    out_.set_tokens_written(out_.tokens_written() + out.tokens_written);
    out_.set_tokens_duplicate(out_.tokens_duplicate() + out.tokens_duplicate);
    out_.set_tokens_shared(out_.tokens_shared() + out.tokens_shared);
    for (const auto& [id, layer, tokens] : out.lengths) lengths_[{id, layer}] = tokens;
    return absl::OkStatus();
  }

  void Done(const absl::Status& st) {
    size_t in;
    {
      absl::MutexLock l(&mu_);
      in = bytes_in_;
    }
    svc_->idle_streams()->Remove(this);
    bool own_buffer = false;
    if (st.ok()) {
      grpc::SerializationTraits<v1::PutBlocksResponse>::Serialize(out_, resp_, &own_buffer);
    }
    Finish(call_.End(st, in, st.ok() ? out_.ByteSizeLong() : 0));
  }

  Service* svc_;
  grpc::ByteBuffer* resp_;
  v1::PutBlocksResponse out_;  // serialized into resp_ on success
  Call call_;
  absl::Mutex mu_;
  std::unique_ptr<grpc::ByteBuffer> buf_;  // the outstanding read's target
  std::deque<std::unique_ptr<grpc::ByteBuffer>> queue_ ABSL_GUARDED_BY(mu_);
  bool reading_ ABSL_GUARDED_BY(mu_) = false;   // a read is outstanding
  bool applying_ ABSL_GUARDED_BY(mu_) = false;  // a worker is draining the queue
  bool eof_ ABSL_GUARDED_BY(mu_) = false;       // no more messages will come
  bool done_ ABSL_GUARDED_BY(mu_) = false;      // Finish was (or is being) called
  size_t bytes_in_ ABSL_GUARDED_BY(mu_) = 0;
  // Touched only by the worker draining the queue (one at a time) and by Succeed, which
  // runs after the last drain.
  std::map<std::pair<std::string, int>, int64_t> lengths_;
  int64_t messages_seen_ = 0;
};

}  // namespace

grpc::ServerReadReactor<grpc::ByteBuffer>* Service::PutBlocks(grpc::CallbackServerContext* ctx,
                                                              grpc::ByteBuffer* resp) {
  return new PutBlocksReactor(this, ctx, resp);
}

// ---------------------------------------------------------------------------- reads

namespace {

// Runs fn(0..n-1) on the calling worker and on idle pool workers (work sharing through an
// atomic index). The caller always makes progress itself, so a busy pool only means less
// parallelism, never a wait for a queued task; helpers that start late find no item left.
// Items must be independent: callers pass serial = true when two items name one sequence
// (observing Attends on one sequence must keep their order). An item reached after the call
// stopped being wanted is skipped, and the call answers why (Call::StillWanted).
absl::Status ForEachItem(core::WorkerPool* pool, const Call& call, int n, bool serial,
                         const std::function<void(int)>& fn) {
  // std::mutex rather than absl::Mutex: ThreadSanitizer intercepts it, and Debian's Abseil is
  // not built for TSan (scripts/sanitize.sh tsan-server).
  struct State {
    const Call* call;
    std::function<void(int)> fn;
    int n;
    std::atomic<int> next{0};
    std::mutex mu;
    std::condition_variable all_done;
    int done = 0;       // guarded by mu
    absl::Status gone;  // guarded by mu: the first item skipped, why
  };
  auto st = std::make_shared<State>();
  st->call = &call;
  st->fn = fn;
  st->n = n;
  auto work = [](State* s) {
    for (int i; (i = s->next.fetch_add(1)) < s->n;) {
      absl::Status gone = s->call->StillWanted(i, s->n);
      if (gone.ok()) s->fn(i);
      std::lock_guard<std::mutex> l(s->mu);
      if (s->gone.ok()) s->gone = gone;
      if (++s->done == s->n) s->all_done.notify_all();
    }
  };
  if (n > 1 && !serial && pool->size() > 1) {
    const int helpers = std::min<int>(n - 1, static_cast<int>(pool->size()) - 1);
    for (int h = 0; h < helpers; ++h) pool->Submit([st, work] { work(st.get()); });
  }
  work(st.get());
  std::unique_lock<std::mutex> l(st->mu);
  st->all_done.wait(l, [&] { return st->done == st->n; });
  return st->gone;
}

template <typename Items>
bool SharesASequence(const Items& items) {
  absl::flat_hash_set<std::string> ids;
  for (const auto& it : items) {
    if (!ids.insert(it.sequence_id()).second) return true;
  }
  return false;
}

}  // namespace

template <class Item>
absl::Status Service::ItemAppend(const std::string& tenant, const Item& item,
                                 const std::string& at) {
  // The decode step's new tokens first, exactly as a PutBlocks append of them.
  const v1::Append& ap = item.append();
  if (ap.sequence_id() != item.sequence_id() || ap.layer() != item.layer()) {
    return absl::InvalidArgumentError(
        absl::StrCat(at, ".append names sequence '", ap.sequence_id(), "' layer ", ap.layer(),
                     "; it must be the item's own (sequence '", item.sequence_id(), "' layer ",
                     item.layer(), ")"));
  }
  core::AppendSpec spec;
  SpecStorage storage;
  RETURN_IF_ERROR(SpecOf(ap, at + ".append", &spec, &storage));
  core::AppendOutcome outcome;
  // The store names the item by its batch index; on the wire it is this item's append.
  return core::RenameField(store_->Append(tenant, {spec}, &outcome), "appends[0]", at + ".append");
}

grpc::ServerUnaryReactor* Service::Score(grpc::CallbackServerContext* ctx,
                                         const v1::ScoreRequest* req, v1::ScoreResponse* resp) {
  return Unary("Score", CallKind::kPooled, ctx, req, resp, [this, req, resp](const Call& call) {
    const std::string& tenant = call.tenant();
    RETURN_IF_ERROR(CheckBatch(req->items_size()));
    for (int i = 0; i < req->items_size(); ++i) resp->add_results();
    return ForEachItem(pool_, call, req->items_size(), SharesASequence(req->items()), [&](int i) {
      const v1::ScoreItem& item = req->items(i);
      v1::ScoreResult* r = resp->mutable_results(i);
      const std::string at = absl::StrCat("items[", i, "]");
      std::vector<float> q, out;
      int q_heads = 0, n_q = 0, d = 0;
      int64_t tokens = 0;
      absl::Status st = CheckId(item.sequence_id(), at + ".sequence_id");
      if (st.ok()) st = QueriesToFloat(item.queries(), at + ".queries", &q, &q_heads, &n_q, &d);
      if (st.ok() && item.has_append()) st = ItemAppend(tenant, item, at);
      if (st.ok()) {
        st = Prefix(store_->Score({tenant, item.sequence_id(), item.layer(), item.basis_version()},
                                  {q.data(), q_heads, n_q, d}, item.scale(),
                                  item.corrections_only(), &out, &tokens),
                    at);
      }
      if (st.ok()) {
        wire::FillTensor(out.data(), {q_heads, n_q, tokens}, v1::DTYPE_F32, r->mutable_logits());
        r->set_tokens(tokens);
      }
      SetItemStatus(st, r->mutable_status());
    });
  });
}

grpc::ServerUnaryReactor* Service::Readout(grpc::CallbackServerContext* ctx,
                                           const v1::ReadoutRequest* req,
                                           v1::ReadoutResponse* resp) {
  return Unary("Readout", CallKind::kPooled, ctx, req, resp, [this, req, resp](const Call& call) {
    const std::string& tenant = call.tenant();
    RETURN_IF_ERROR(CheckBatch(req->items_size()));
    for (int i = 0; i < req->items_size(); ++i) resp->add_results();
    return ForEachItem(pool_, call, req->items_size(), false, [&](int i) {
      const v1::ReadoutItem& item = req->items(i);
      v1::ReadoutResult* r = resp->mutable_results(i);
      const std::string at = absl::StrCat("items[", i, "]");
      std::vector<float> p, out;
      int64_t tokens = 0;
      int q_heads = 0, n_q = 0;
      absl::Status st = CheckId(item.sequence_id(), at + ".sequence_id");
      absl::StatusOr<core::TensorView> w;
      if (st.ok()) {
        w = wire::ViewOf(item.weights(), at + ".weights", 3, 3);
        st = w.status();
      }
      if (st.ok() && w->dtype != core::DType::kF32) {
        st = absl::InvalidArgumentError(absl::StrCat(at, ".weights.dtype must be DTYPE_F32"));
      }
      if (st.ok() && w->shape[1] > kMaxQueriesPerItem) {
        st = absl::InvalidArgumentError(absl::StrCat(at, ".weights.shape[1] ", w->shape[1],
                                                     " exceeds the limit ", kMaxQueriesPerItem));
      }
      if (st.ok() && item.output_dtype() != v1::DTYPE_UNSPECIFIED) {
        st = wire::FromProto(item.output_dtype(), at + ".output_dtype").status();
      }
      if (st.ok()) {
        q_heads = static_cast<int>(w->shape[0]);
        n_q = static_cast<int>(w->shape[1]);
        p.resize(w->numel());
        core::ToFloat(core::DType::kF32, w->data, p.data(), p.size());
        st =
            Prefix(store_->Readout({tenant, item.sequence_id(), item.layer(), item.basis_version()},
                                   {p.data(), q_heads, n_q, w->shape[2]}, item.weights_are_logits(),
                                   &out, &tokens),
                   at);
      }
      if (st.ok()) {
        const int64_t d = static_cast<int64_t>(out.size()) / (int64_t{q_heads} * n_q);
        wire::FillTensor(out.data(), {q_heads, n_q, d}, item.output_dtype(), r->mutable_outputs());
        r->set_tokens(tokens);
      }
      SetItemStatus(st, r->mutable_status());
    });
  });
}

grpc::ServerUnaryReactor* Service::Attend(grpc::CallbackServerContext* ctx,
                                          const v1::AttendRequest* req, v1::AttendResponse* resp) {
  return Unary("Attend", CallKind::kPooled, ctx, req, resp, [this, req, resp](const Call& call) {
    const std::string& tenant = call.tenant();
    RETURN_IF_ERROR(CheckBatch(req->items_size()));
    for (int i = 0; i < req->items_size(); ++i) resp->add_results();
    return ForEachItem(pool_, call, req->items_size(), SharesASequence(req->items()), [&](int i) {
      const v1::AttendItem& item = req->items(i);
      v1::AttendResult* r = resp->mutable_results(i);
      const std::string at = absl::StrCat("items[", i, "]");
      std::vector<float> q, out;
      int q_heads = 0, n_q = 0, d = 0;
      int64_t tokens = 0;
      absl::Status st = CheckId(item.sequence_id(), at + ".sequence_id");
      if (st.ok()) st = QueriesToFloat(item.queries(), at + ".queries", &q, &q_heads, &n_q, &d);
      if (st.ok() && item.output_dtype() != v1::DTYPE_UNSPECIFIED) {
        st = wire::FromProto(item.output_dtype(), at + ".output_dtype").status();
      }
      if (st.ok() && item.has_causal_offset() && item.causal_offset() < 0) {
        st = absl::InvalidArgumentError(
            absl::StrCat(at, ".causal_offset ", item.causal_offset(), " must be >= 0"));
      }
      if (st.ok() && item.has_append()) st = ItemAppend(tenant, item, at);
      if (st.ok()) {
        core::AttendOptions ao;
        ao.causal_offset = item.has_causal_offset() ? item.causal_offset() : -1;
        ao.observe = item.has_observe() ? item.observe() : true;
        ao.scale = item.scale();
        // Split policy (ServerOptions::split_attend_min_tokens): decided as the item starts,
        // from the workers idle then; the store applies it only to a layer that long.
        core::RunParts run_parts;
        ao.parts = core::AttendSplitParts(split_min_tokens_, pool_->idle(),
                                          static_cast<int>(pool_->size()));
        if (ao.parts > 1) {
          ao.split_min_tokens = split_min_tokens_;
          run_parts = [this, claim = core::ClaimingRunParts(pool_, ao.parts - 1)](
                          int n, const std::function<void(int)>& task) {
            if (split_metrics_ != nullptr) split_metrics_->RecordAttendSplit();
            claim(n, task);
          };
          ao.run_parts = &run_parts;
        }
        st = Prefix(store_->Attend({tenant, item.sequence_id(), item.layer(), item.basis_version()},
                                   {q.data(), q_heads, n_q, d}, ao, &out, &tokens),
                    at);
      }
      if (st.ok()) {
        wire::FillTensor(out.data(), {q_heads, n_q, d}, item.output_dtype(), r->mutable_outputs());
        r->set_tokens(tokens);
      }
      SetItemStatus(st, r->mutable_status());
    });
  });
}

// ---------------------------------------------------------------------------- GetBlocks

namespace {

class GetBlocksReactor final : public grpc::ServerWriteReactor<v1::GetBlocksResponse> {
 public:
  GetBlocksReactor(Service* svc, grpc::CallbackServerContext* ctx, const v1::GetBlocksRequest* req)
      : svc_(svc),
        req_(*req),
        call_(svc->calls(), "GetBlocks", *ctx, CallKind::kPooled),
        bytes_in_(req->ByteSizeLong()) {
    if (!call_.admission().ok()) {
      Done(call_.admission());
      return;
    }
    svc_->pool()->Submit([this] { Next(); });
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Done(absl::CancelledError("the client went away"));
      return;
    }
    bytes_out_ += msg_.ByteSizeLong();
    svc_->pool()->Submit([this] { Next(); });
  }

  void OnDone() override { delete this; }

 private:
  // Runs on the pool: writes the next chunk, or finishes.
  void Next() {
    absl::Status st;
    {
      // Successive Next()s run on any pool worker, one at a time: each is submitted from
      // OnWriteDone after the previous one's write. That order passes through gRPC, which
      // ThreadSanitizer cannot see into; this uncontended lock states it where it can. (Finish,
      // in Done, stays outside: OnDone may delete the reactor, and the lock with it.)
      std::lock_guard<std::mutex> l(producing_);
      st = Produce();
      if (st.ok() && !finished_) {
        StartWrite(&msg_);
        return;
      }
    }
    Done(st);
  }

  absl::Status Produce() {
    if (!started_) {
      started_ = true;
      RETURN_IF_ERROR(call_.StillWanted());
      RETURN_IF_ERROR(CheckId(req_.sequence_id(), "sequence_id"));
      if (req_.max_tokens_per_message() < 0) {
        return absl::InvalidArgumentError("max_tokens_per_message must be >= 0 (0: 4096)");
      }
      chunk_ = req_.max_tokens_per_message() ? req_.max_tokens_per_message() : 4096;
      if (req_.from_token() < 0 || req_.to_token() < 0 ||
          (req_.to_token() > 0 && req_.to_token() < req_.from_token())) {
        return absl::InvalidArgumentError(
            absl::StrCat("from_token ", req_.from_token(), " and to_token ", req_.to_token(),
                         " must be >= 0 with from_token <= to_token (to_token 0: to the end)"));
      }
      // Decoded straight into the wire dtype (unspecified: fp32).
      wire_dtype_ = req_.dtype() == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_F32 : req_.dtype();
      ASSIGN_OR_RETURN(dtype_, wire::FromProto(wire_dtype_, "dtype"));
      ASSIGN_OR_RETURN(core::SequenceInfo info,
                       svc_->store()->Describe(call_.tenant(), req_.sequence_id()));
      if (req_.basis_version() != 0 && req_.basis_version() != info.model->manifest.version) {
        return absl::FailedPreconditionError(
            absl::StrCat("basis_version ", req_.basis_version(), ": sequence '", req_.sequence_id(),
                         "' is pinned to version ", info.model->manifest.version));
      }
      kv_heads_ = info.model->manifest.kv_heads;
      d_ = info.model->manifest.head_dim;
      version_ = info.model->manifest.version;
      group_ = info.codec.key_group;
      if (req_.codes()) {
        model_ = info.model->manifest.model;
        ASSIGN_OR_RETURN(codec_, wire::CodecToWire(info.codec));
      }
      if (info.codec.rank > 0) fingerprint_ = info.model->manifest.fingerprint;
      if (req_.codes() && req_.max_block_version() < format::kMinVersion) {
        return absl::FailedPreconditionError(absl::StrCat(
            "max_block_version ", req_.max_block_version(),
            ": codes need a client that reads block-format versions this server writes (",
            format::kMinVersion, " to ", format::kMaxVersion, ")"));
      }
      // Every layer is read up to its length now (taken under the sequence's lock in one
      // step): appends that land while the stream is under way are not seen.
      snapshot_ = info.layer_tokens;
      const int n_layers = info.model->manifest.layers;
      if (req_.layers_size() == 0) {
        for (int l = 0; l < n_layers; ++l) layers_.push_back(l);
      }
      for (int i = 0; i < req_.layers_size(); ++i) {
        if (req_.layers(i) < 0 || req_.layers(i) >= n_layers) {
          return absl::InvalidArgumentError(
              absl::StrCat("layers[", i, "] = ", req_.layers(i), " must be in 0..", n_layers - 1));
        }
        layers_.push_back(req_.layers(i));
      }
    }
    if (req_.codes()) return ProduceCodes();
    // The layer's range is decoded a window at a time (at most kDecodeWindow tokens, or one
    // message's), so that a stream holds a bounded fp32 copy however long the layer and
    // however slowly its client reads. Next layer once this one's range is sent (an empty
    // range of a non-empty layer sends one message with n = 0; an empty layer sends none).
    while (offset_ >= decoded_) {
      if (layer_open_ && first_ + decoded_ < end_) {  // the next window of this layer
        RETURN_IF_ERROR(DecodeWindow(first_ + decoded_));
        break;
      }
      if (layer_open_ && !layer_sent_ && tokens_ > 0) break;  // its one empty message
      if (next_layer_ >= layers_.size()) {
        finished_ = true;
        return absl::OkStatus();
      }
      layer_ = layers_[next_layer_++];
      layer_open_ = true;
      layer_sent_ = false;
      const int64_t length = layer_ < static_cast<int>(snapshot_.size()) ? snapshot_[layer_] : 0;
      length_ = length;
      end_ = req_.to_token() > 0 ? std::min<int64_t>(req_.to_token(), length) : length;
      if (req_.from_token() == 0 && end_ == length) {
        // The whole layer: every block checked before its first message goes out.
        RETURN_IF_ERROR(svc_->store()->VerifyLayer(call_.tenant(), req_.sequence_id(), layer_,
                                                   req_.basis_version()));
      }
      offset_ = decoded_ = 0;
      RETURN_IF_ERROR(DecodeWindow(req_.from_token()));
      end_ = std::min(end_, tokens_);
      if (tokens_ == 0) layer_open_ = false;  // an empty layer sends nothing
    }
    layer_sent_ = true;
    const int64_t n = std::min<int64_t>(chunk_, decoded_ - offset_);
    msg_.Clear();
    msg_.set_layer(layer_);
    msg_.set_start(first_ + offset_);
    msg_.set_layer_tokens(tokens_);
    msg_.set_basis_version(version_);
    CopyRows(keys_, n, msg_.mutable_keys());
    CopyRows(values_, n, msg_.mutable_values());
    offset_ += n;
    return absl::OkStatus();
  }

  // Codes: the next message of whole groups (at most chunk_ tokens of them, at least one group),
  // then the window's rows, layer after layer.
  absl::Status ProduceCodes() {
    for (;;) {
      if (layer_open_ && (pos_ < end_ || !layer_sent_)) break;
      if (next_layer_ >= layers_.size()) {
        finished_ = true;
        return absl::OkStatus();
      }
      layer_ = layers_[next_layer_++];
      length_ = layer_ < static_cast<int>(snapshot_.size()) ? snapshot_[layer_] : 0;
      end_ = req_.to_token() > 0 ? std::min<int64_t>(req_.to_token(), length_) : length_;
      pos_ = std::min(req_.from_token(), end_);
      layer_open_ = length_ > 0;  // an empty layer sends nothing
      layer_sent_ = false;
      if (layer_open_ && req_.from_token() == 0 && end_ == length_) {
        RETURN_IF_ERROR(svc_->store()->VerifyLayer(call_.tenant(), req_.sequence_id(), layer_,
                                                   req_.basis_version()));
      }
    }
    const int64_t chunk = std::max<int64_t>(group_, chunk_ / group_ * group_);
    const int64_t to = end_ - pos_ <= chunk ? end_ : pos_ + chunk;
    core::EncodedGroups groups;
    int64_t first = 0;
    RETURN_IF_ERROR(svc_->store()->ReadEncoded(call_.tenant(), req_.sequence_id(), layer_,
                                               req_.basis_version(), pos_, to, dtype_, &groups,
                                               &keys_, &values_, &tokens_, &first));
    const std::vector<size_t> at = core::RunOffsets(core::ViewOf(groups));
    for (size_t b = 0; b < groups.sizes.size(); ++b) {
      const int version = groups.bytes[at[b] + format::kVersionAt];
      if (version > req_.max_block_version()) {
        return absl::FailedPreconditionError(
            absl::StrCat("layer ", layer_, " holds blocks of block-format version ", version,
                         "; the client reads versions up to ", req_.max_block_version(),
                         " (max_block_version)"));
      }
    }
    const bool first_of_layer = !layer_sent_;
    layer_sent_ = true;
    pos_ = std::max(to, first + groups.groups * group_);
    msg_.Clear();
    if (first_of_layer) {
      msg_.set_model(model_);
      *msg_.mutable_codec() = codec_;
    }
    msg_.set_layer(layer_);
    msg_.set_start(first);
    msg_.set_layer_tokens(std::min(tokens_, length_));
    msg_.set_basis_version(version_);
    if (groups.groups > 0) groups.basis_fingerprint = fingerprint_;
    wire::EncodedToWire(groups, kv_heads_, d_, msg_.mutable_encoded());
    // The window rows: all of them, whatever chunk_ (at most R + G - 1 tokens).
    decoded_ =
        static_cast<int64_t>(keys_.size() / core::DTypeSize(dtype_)) / (int64_t{kv_heads_} * d_);
    offset_ = 0;
    CopyRows(keys_, decoded_, msg_.mutable_keys());
    CopyRows(values_, decoded_, msg_.mutable_values());
    return absl::OkStatus();
  }

  // Tokens [offset_, offset_ + n) of every head of the decoded window `rows` ([kv][decoded_][d]
  // elements of dtype_) as a [kv][n][d] tensor: the bytes as decoded, one copy per head.
  void CopyRows(const std::vector<uint8_t>& rows, int64_t n, v1::Tensor* out) const {
    const size_t row = static_cast<size_t>(d_) * core::DTypeSize(dtype_);
    out->set_dtype(wire_dtype_);
    for (int64_t dim : {int64_t{kv_heads_}, n, int64_t{d_}}) out->add_shape(dim);
    std::string* bytes = out->mutable_data();
    bytes->resize(static_cast<size_t>(kv_heads_) * n * row);
    if (n == 0) return;  // an empty range's one message: rows may be empty (null data())
    for (int h = 0; h < kv_heads_; ++h) {
      std::memcpy(bytes->data() + h * n * row,
                  rows.data() + (static_cast<size_t>(h) * decoded_ + offset_) * row, n * row);
    }
  }

  // Decodes tokens [from, min(end_, from + window)) of the current layer into keys_/values_
  // (first_: where they start; tokens_: the layer's length).
  absl::Status DecodeWindow(int64_t from) {
    // Whole messages per window: only the range's last message is short.
    const int64_t window = std::max<int64_t>(chunk_, kDecodeWindow / chunk_ * chunk_);
    RETURN_IF_ERROR(svc_->store()->DecodeAs(
        call_.tenant(), req_.sequence_id(), layer_, req_.basis_version(), from,
        // (end_ - from, not from + window: a request's start may lie near INT64_MAX)
        end_ - from <= window ? end_ : from + window, dtype_, &keys_, &values_, &tokens_, &first_));
    tokens_ = std::min(tokens_, length_);  // appends after the call started are not seen
    decoded_ =
        static_cast<int64_t>(keys_.size() / core::DTypeSize(dtype_)) / (int64_t{kv_heads_} * d_);
    offset_ = 0;
    return absl::OkStatus();
  }

  void Done(const absl::Status& st) { Finish(call_.End(st, bytes_in_, bytes_out_)); }

  Service* svc_;
  const v1::GetBlocksRequest req_;
  Call call_;
  size_t bytes_in_ = 0, bytes_out_ = 0;
  std::mutex producing_;  // held by Produce (see Next)
  bool started_ = false, finished_ = false;
  int64_t chunk_ = 4096;
  int kv_heads_ = 0, d_ = 0, version_ = 0;
  std::vector<int> layers_;
  std::vector<int64_t> snapshot_;  // every layer's length when the call started
  size_t next_layer_ = 0;
  int layer_ = 0;
  // The current layer: its length (tokens_, at most length_, its length when the call
  // started), the end of the requested range (end_), the window decoded ([first_, first_ +
  // decoded_)), the next message's offset in it, and whether a message of it went out.
  // Tokens decoded per window: about this many, a whole number of messages (at least one).
  static constexpr int64_t kDecodeWindow = 1024;
  int64_t offset_ = 0, tokens_ = 0, first_ = 0, decoded_ = 0, end_ = 0, length_ = 0;
  // Codes: the codec's group size and the next token of the current layer to send.
  int64_t group_ = 1, pos_ = 0;
  std::string fingerprint_;  // of the basis the side codes use ("" at rank 0)
  std::string model_;        // the sequence's model and codec, for a client's decoder
  v1::CodecSettings codec_;
  bool layer_open_ = false, layer_sent_ = true;
  v1::DType wire_dtype_ = v1::DTYPE_F32;
  core::DType dtype_ = core::DType::kF32;
  std::vector<uint8_t> keys_, values_;  // the window, [kv][decoded_][d] of dtype_
  v1::GetBlocksResponse msg_;
};

}  // namespace

grpc::ServerWriteReactor<v1::GetBlocksResponse>* Service::GetBlocks(
    grpc::CallbackServerContext* ctx, const v1::GetBlocksRequest* req) {
  return new GetBlocksReactor(this, ctx, req);
}

// ---------------------------------------------------------------------------- misc

grpc::ServerUnaryReactor* Service::DeleteSequence(grpc::CallbackServerContext* ctx,
                                                  const v1::DeleteSequenceRequest* req,
                                                  v1::DeleteSequenceResponse* resp) {
  return Unary("DeleteSequence", CallKind::kPooled, ctx, req, resp,
               [this, req, resp](const Call& call) {
                 const std::string& tenant = call.tenant();
                 RETURN_IF_ERROR(CheckId(req->sequence_id(), "sequence_id"));
                 ASSIGN_OR_RETURN(int64_t freed, store_->Delete(tenant, req->sequence_id()));
                 resp->set_bytes_freed(freed);
                 return absl::OkStatus();
               });
}

grpc::ServerUnaryReactor* Service::Stats(grpc::CallbackServerContext* ctx,
                                         const v1::StatsRequest* req, v1::StatsResponse* resp) {
  return Unary("Stats", CallKind::kInline, ctx, req, resp, [this, resp](const Call& call) {
    const std::string& tenant = call.tenant();
    const core::UsageStats t = store_->TenantUsage(tenant);
    const core::UsageStats all = store_->TotalUsage();
    resp->set_tenant(tenant);
    resp->set_sequences(t.sequences);
    resp->set_tokens(t.tokens);
    resp->set_stored_bytes(t.bytes);
    resp->set_quota_bytes(store_->options().tenant_quota_bytes);
    resp->set_evictions(t.evictions);
    resp->set_prefix_blocks(t.prefix_blocks);
    resp->set_prefix_bytes(t.prefix_bytes);
    resp->set_retained_prefix_bytes(t.retained_bytes);
    resp->set_shared_tokens(t.shared_tokens);
    resp->set_client_inflight(calls_.HeldBy(call.ClientKey()));
    resp->set_client_inflight_limit(calls_.max_inflight_per_client());
    resp->set_server_inflight_limit(calls_.max_inflight());
    resp->set_k_bits_per_element(t.k_bits());
    resp->set_v_bits_per_element(t.v_bits());
    resp->set_server_stored_bytes(all.bytes);
    resp->set_server_capacity_bytes(store_->options().capacity_bytes);
    resp->set_memory_pool(pool_name_);
    resp->set_compute_backend(backend_name_);
    resp->set_uptime_seconds(absl::ToDoubleSeconds(absl::Now() - started_));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* Service::Echo(grpc::CallbackServerContext* ctx,
                                        const v1::EchoRequest* req, v1::EchoResponse* resp) {
  return Unary("Echo", CallKind::kProbe, ctx, req, resp, [req, resp](const Call&) {
    *resp->mutable_payload() = req->payload();
    return absl::OkStatus();
  });
}

}  // namespace kvq::server
