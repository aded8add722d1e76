// One tenant's prefix index: sealed groups by chained key, held or retained.
#include "core/src/store/prefix_index.h"

#include <array>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "kvq/core/codec_json.h"
#include "xxhash.h"

namespace kvq::core {

PrefixKey PrefixSeed(const ModelEntry& m, const CodecOptions& c, int layer) {
  // The codec as codec.json writes it (every stored field, so that no field can be left out
  // here) plus head_dim, the model's shape rather than a setting.
  const std::string s = absl::StrCat("kvq-prefix-v2|", m.manifest.model, "|", m.manifest.version,
                                     "|", m.manifest.fingerprint, "|", m.has_basis, "|",
                                     CodecToJson(c).dump(), "|", c.head_dim, "|", layer);
  const XXH128_hash_t h = XXH3_128bits(s.data(), s.size());
  return {h.low64, h.high64};
}

PrefixKey ChainKey(const PrefixKey& prev, const uint32_t* ids, int g) {
  std::array<uint8_t, 16 + 4 * 128> buf;  // G <= 128 (CodecOptions::Validate)
  std::memcpy(buf.data(), &prev.first, 8);
  std::memcpy(buf.data() + 8, &prev.second, 8);
  std::memcpy(buf.data() + 16, ids, 4 * static_cast<size_t>(g));
  const XXH128_hash_t h = XXH3_128bits(buf.data(), 16 + 4 * static_cast<size_t>(g));
  return {h.low64, h.high64};
}

namespace {

// What one indexed group takes, counted against the tenant: the block's bytes (their
// capacity), offsets and sinks, its arrival hashes, and the index's bookkeeping: the hash-map
// slot (at the map's lowest load, 7/8), the SealedBlock object with its shared_ptr control
// block, the vectors' heap headers, its key in its parent's children (with the vector's
// doubling) and its entry in the retained set (every group is retained once unused). A heap
// block costs malloc's 16-byte header on glibc x86-64.
int64_t IndexedGroupBytes(const PrefixIndex::Entry& n) {
  constexpr int64_t kHeader = 16;
  const SealedBlock& b = *n.block;
  using Slot = std::pair<const PrefixKey, PrefixIndex::Entry>;
  const int64_t slot = static_cast<int64_t>(sizeof(Slot) + 1);
  int64_t bytes = slot * 8 / 7 + 1;
  bytes += static_cast<int64_t>(sizeof(SealedBlock)) + 16 + kHeader;  // make_shared
  bytes += static_cast<int64_t>(b.bytes.capacity()) + kHeader;
  bytes += static_cast<int64_t>(b.offsets.capacity() * sizeof(uint32_t)) + kHeader;
  if (b.sinks)
    bytes += b.sinks->bytes() + static_cast<int64_t>(sizeof(SinkRows)) + 16 + 3 * kHeader;
  bytes += static_cast<int64_t>(n.hashes.capacity() * sizeof(uint64_t)) + kHeader;
  bytes += 2 * static_cast<int64_t>(sizeof(PrefixKey)) + kHeader;  // in the parent's children
  // Its retained-set entry: a red-black node (32 bytes) around (time, key).
  bytes += 32 + static_cast<int64_t>(sizeof(std::pair<absl::Time, PrefixKey>)) + kHeader;
  return bytes;
}

}  // namespace

const PrefixIndex::Entry* PrefixIndex::Find(const PrefixKey& key) const {
  auto e = entries_.find(key);
  return e == entries_.end() ? nullptr : &e->second;
}

int64_t PrefixIndex::Insert(const PrefixKey& key, std::optional<PrefixKey> parent,
                            SealedBlockPtr block, std::span<const uint64_t> hashes,
                            absl::Time now) {
  Entry e;
  e.block = std::move(block);
  e.hashes.assign(hashes.begin(), hashes.end());
  if (parent) {
    e.parent = parent;
    auto p = entries_.find(*parent);
    if (p != entries_.end()) p->second.children.push_back(key);
  }
  e.refs = 1;
  e.last_used = now;
  e.bytes = IndexedGroupBytes(e);
  const int64_t bytes = e.bytes;
  bytes_ += bytes;
  entries_.emplace(key, std::move(e));
  return bytes;
}

bool PrefixIndex::Hold(const PrefixKey& key) {
  auto e = entries_.find(key);
  if (e == entries_.end()) return false;
  if (e->second.refs++ == 0) {
    retained_.erase({e->second.last_used, key});
    retained_bytes_ -= e->second.bytes;
  }
  return true;
}

bool PrefixIndex::Release(const PrefixKey& key) {
  auto e = entries_.find(key);
  if (e == entries_.end() || --e->second.refs != 0) return false;
  retained_.emplace(e->second.last_used, key);
  retained_bytes_ += e->second.bytes;
  return true;
}

void PrefixIndex::Touch(const PrefixKey& key, absl::Time now) {
  auto e = entries_.find(key);
  if (e == entries_.end()) return;
  if (e->second.refs == 0) {  // re-keyed in the retained set, which orders by it
    retained_.erase({e->second.last_used, key});
    retained_.emplace(now, key);
  }
  e->second.last_used = now;
}

PrefixIndex::Run PrefixIndex::HoldRun(PrefixKey prev, std::span<const uint32_t> ids, int group,
                                      int64_t max_groups) {
  Run run;
  for (int64_t b = 0; b < max_groups && (b + 1) * group <= static_cast<int64_t>(ids.size()); ++b) {
    prev = ChainKey(prev, ids.data() + b * group, group);
    auto e = entries_.find(prev);
    if (e == entries_.end()) break;
    Hold(prev);
    run.keys.push_back(prev);
    run.blocks.push_back(e->second.block);
    run.hashes.insert(run.hashes.end(), e->second.hashes.begin(), e->second.hashes.end());
  }
  return run;
}

int64_t PrefixIndex::RunLength(PrefixKey prev, std::span<const uint32_t> ids, int group,
                               int64_t max_groups) const {
  int64_t b = 0;
  for (; b < max_groups && (b + 1) * group <= static_cast<int64_t>(ids.size()); ++b) {
    prev = ChainKey(prev, ids.data() + b * group, group);
    if (!entries_.contains(prev)) break;
  }
  return b;
}

int64_t PrefixIndex::Drop(PrefixKey key) {
  int64_t freed = 0;
  std::vector<PrefixKey> stack{key};
  while (!stack.empty()) {
    const PrefixKey k = stack.back();
    stack.pop_back();
    auto e = entries_.find(k);
    if (e == entries_.end()) continue;
    for (const PrefixKey& c : e->second.children) stack.push_back(c);
    // Only the first entry's parent stays; the others' parents go with them.
    if (e->second.parent && k == key) {
      auto p = entries_.find(*e->second.parent);
      if (p != entries_.end()) std::erase(p->second.children, k);
    }
    freed += e->second.bytes;
    if (e->second.refs == 0) {
      retained_.erase({e->second.last_used, k});
      retained_bytes_ -= e->second.bytes;
    }
    entries_.erase(e);
  }
  bytes_ -= freed;
  return freed;
}

int64_t PrefixIndex::DropRetained(int64_t need, absl::Time older_than) {
  int64_t freed = 0;
  // Each drop removes the front entry (with its extensions), so the loop ends.
  while (!retained_.empty() && retained_.begin()->first < older_than &&
         !(need > 0 && freed >= need)) {
    freed += Drop(retained_.begin()->second);
  }
  return freed;
}

std::vector<PrefixKey> PrefixIndex::CorruptRetained() const {
  std::vector<PrefixKey> corrupt;
  for (const auto& [time, key] : retained_) {
    if (!entries_.at(key).block->Verify().ok()) corrupt.push_back(key);
  }
  return corrupt;
}

}  // namespace kvq::core
