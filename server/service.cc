#include "server/service.h"

#include <algorithm>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "kvq/core/field_error.h"
#include "kvq/core/status.h"
#include "kvq/wire/codec_settings.h"
#include "kvq/wire/encoded_groups.h"
#include "kvq/wire/model.h"
#include "kvq/wire/tensor.h"
#include "server/convert.h"

namespace kvq::server {
namespace {

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

// A store read's outcome for item `at`: its error prefixed with the item's path, or OK with
// *tokens the tokens it read.
absl::Status ItemRead(const absl::StatusOr<int64_t>& read, absl::string_view at, int64_t* tokens) {
  if (!read.ok()) return Prefix(read.status(), at);
  *tokens = *read;
  return absl::OkStatus();
}

}  // namespace

Service::Service(ServiceOptions opts)
    : store_(opts.store),
      registry_(opts.registry),
      auth_(opts.calls.auth),
      pool_(opts.pool),
      pool_name_(std::move(opts.pool_name)),
      backend_name_(std::move(opts.backend_name)),
      started_(absl::Now()),
      calls_(opts.calls),
      split_min_tokens_(opts.split_attend_min_tokens),
      split_metrics_(opts.split_metrics),
      idle_(std::make_unique<IdleStreams>(opts.stream_idle_timeout)) {}

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
    ASSIGN_OR_RETURN(s.codec, CreationCodecOf(a.model(), a.basis_version(), a.codec(), at));
    s.has_codec = true;
  }
  return absl::OkStatus();
}

absl::StatusOr<core::CodecOptions> Service::CreationCodecOf(const std::string& model, int version,
                                                            const v1::CodecSettings& settings,
                                                            const std::string& at) const {
  const std::string prefix = at.empty() ? "" : at + ".";
  absl::StatusOr<std::shared_ptr<const core::ModelEntry>> m = registry_->Get(model, version);
  if (!m.ok()) return Prefix(m.status(), prefix + "model");
  return wire::MergeCodec((*m)->codec, settings, prefix + "codec");
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
        st = ItemRead(
            store_->Score({tenant, item.sequence_id(), item.layer(), item.basis_version()},
                          {q.data(), q_heads, n_q, d}, item.scale(), item.corrections_only(), &out),
            at, &tokens);
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
        st = ItemRead(
            store_->Readout({tenant, item.sequence_id(), item.layer(), item.basis_version()},
                            {p.data(), q_heads, n_q, w->shape[2]}, item.weights_are_logits(), &out),
            at, &tokens);
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
        st = ItemRead(
            store_->Attend({tenant, item.sequence_id(), item.layer(), item.basis_version()},
                           {q.data(), q_heads, n_q, d}, ao, &out),
            at, &tokens);
      }
      if (st.ok()) {
        wire::FillTensor(out.data(), {q_heads, n_q, d}, item.output_dtype(), r->mutable_outputs());
        r->set_tokens(tokens);
      }
      SetItemStatus(st, r->mutable_status());
    });
  });
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

grpc::ServerUnaryReactor* Service::MatchPrefix(grpc::CallbackServerContext* ctx,
                                               const v1::MatchPrefixRequest* req,
                                               v1::MatchPrefixResponse* resp) {
  return Unary(
      "MatchPrefix", CallKind::kPooled, ctx, req, resp, [this, req, resp](const Call& call) {
        const std::string& tenant = call.tenant();
        if (req->sequence_ids_size() > kMaxBatchItems) {
          return absl::InvalidArgumentError(absl::StrCat(
              "sequence_ids has ", req->sequence_ids_size(), " ids; at most ", kMaxBatchItems));
        }
        for (int i = 0; i < req->sequence_ids_size(); ++i) {
          RETURN_IF_ERROR(CheckId(req->sequence_ids(i), absl::StrCat("sequence_ids[", i, "]")));
        }
        core::PrefixProbe probe;
        probe.model = req->model();
        if (req->basis_version() < 0) {
          return absl::InvalidArgumentError(
              absl::StrCat("basis_version ", req->basis_version(), " must be >= 0"));
        }
        probe.basis_version = req->basis_version();
        probe.token_ids = std::span<const uint32_t>(req->token_ids().data(), req->token_ids_size());
        if (req->has_codec() && !probe.token_ids.empty()) {
          ASSIGN_OR_RETURN(probe.codec,
                           CreationCodecOf(req->model(), req->basis_version(), req->codec(), ""));
          probe.has_codec = true;
        }
        ASSIGN_OR_RETURN(const int64_t indexed, store_->IndexedPrefixTokens(tenant, probe));
        resp->set_indexed_tokens(indexed);
        for (const std::string& id : req->sequence_ids()) {
          absl::StatusOr<core::SequenceInfo> info = store_->Describe(tenant, id);
          int64_t fewest = 0;
          if (info.ok() && !info->layer_tokens.empty()) {
            fewest = *std::min_element(info->layer_tokens.begin(), info->layer_tokens.end());
          } else if (!info.ok() && !absl::IsNotFound(info.status())) {
            return info.status();
          }
          resp->add_sequence_tokens(fewest);
        }
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
