// Store's public methods: each forwards to StoreImpl (store_impl.h), which holds the state.
#include <utility>

#include "core/src/store/store_impl.h"
#include "kvq/core/store.h"

namespace kvq::core {

Store::Store(StoreOptions opts, Registry* registry)
    : impl_(std::make_unique<StoreImpl>(std::move(opts), registry)) {}
Store::~Store() = default;

const StoreOptions& Store::options() const { return impl_->options(); }

absl::Status Store::Append(const std::string& tenant, const std::vector<AppendSpec>& batch,
                           AppendOutcome* outcome) {
  return impl_->Append(tenant, batch, outcome);
}

absl::StatusOr<int64_t> Store::Score(const LayerRef& at, const ReadRows& q, float scale,
                                     bool corrections_only, std::vector<float>* out) {
  return impl_->Score(at, q, scale, corrections_only, out);
}

absl::StatusOr<int64_t> Store::Readout(const LayerRef& at, const ReadRows& p, bool as_logits,
                                       std::vector<float>* out) {
  return impl_->Readout(at, p, as_logits, out);
}

absl::StatusOr<int64_t> Store::Attend(const LayerRef& at, const ReadRows& q,
                                      const AttendOptions& ao, std::vector<float>* out) {
  return impl_->Attend(at, q, ao, out);
}

absl::StatusOr<RangeRead> Store::Decode(const LayerRef& at, TokenRange range,
                                        std::vector<float>* keys, std::vector<float>* values) {
  return impl_->Decode(at, range, keys, values);
}

absl::StatusOr<RangeRead> Store::DecodeAs(const LayerRef& at, TokenRange range, DType dtype,
                                          std::vector<uint8_t>* keys,
                                          std::vector<uint8_t>* values) {
  return impl_->DecodeAs(at, range, dtype, keys, values);
}

absl::StatusOr<RangeRead> Store::ReadEncoded(const LayerRef& at, TokenRange range, DType dtype,
                                             EncodedGroups* groups, std::vector<uint8_t>* keys,
                                             std::vector<uint8_t>* values) {
  return impl_->ReadEncoded(at, range, dtype, groups, keys, values);
}

absl::Status Store::VerifyLayer(const LayerRef& at) { return impl_->VerifyLayer(at); }

absl::StatusOr<SequenceInfo> Store::Describe(const std::string& tenant,
                                             const std::string& sequence_id) {
  return impl_->Describe(tenant, sequence_id);
}

absl::StatusOr<int64_t> Store::IndexedPrefixTokens(const std::string& tenant,
                                                   const PrefixProbe& probe) {
  return impl_->IndexedPrefixTokens(tenant, probe);
}

absl::StatusOr<int64_t> Store::Delete(const std::string& tenant, const std::string& sequence_id) {
  return impl_->Delete(tenant, sequence_id);
}

UsageStats Store::TenantUsage(const std::string& tenant) const {
  return impl_->TenantUsage(tenant);
}
UsageStats Store::TotalUsage() const { return impl_->TotalUsage(); }
std::vector<std::pair<std::string, UsageStats>> Store::AllTenants() const {
  return impl_->AllTenants();
}
int64_t Store::LiveSequences(const std::string& model, int version) const {
  return impl_->LiveSequences(model, version);
}

int64_t Store::Sweep() { return impl_->Sweep(); }
Store::Dropped Store::DropAll() { return impl_->DropAll(); }
int64_t Store::Scrub() { return impl_->Scrub(); }
int64_t Store::RetainedScrubDrops() const { return impl_->RetainedScrubDrops(); }

int64_t Store::LastEvictionPlanStepsForTest() const {
  return impl_->LastEvictionPlanStepsForTest();
}
LayerCache* Store::LayerForTest(const std::string& tenant, const std::string& sequence_id,
                                int layer) {
  return impl_->LayerForTest(tenant, sequence_id, layer);
}

}  // namespace kvq::core
