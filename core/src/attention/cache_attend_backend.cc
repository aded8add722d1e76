// LayerCache's reads on an AttendBackend, where the blocks lie: Attend (the backend's partial
// over the encoded blocks, the fp16 sinks' and the full-precision window's computed here,
// merged by log-sum-exp), and the block halves of Score, Readout, decodes and verification.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvq/core/attend_backend.h"
#include "kvq/core/cache.h"
#include "kvq/core/partial_attention.h"
#include "kvq/core/status.h"
#include "kvq/format/block_format.h"
#include "kvq/kernels/kernels.h"

namespace kvq::core {

namespace {
constexpr float kNone = -std::numeric_limits<float>::infinity();
}  // namespace

void LayerCache::SinkPartial(const SinkRows& sinks, int h, const float* q, int rows, float scale,
                             float* m, float* l, float* o) const {
  const int d = opts_.head_dim, S = sinks.sinks;
  const kernels::KernelTable& k = kernels::Ref();  // ScoreRange's bits (kernels.h)
  thread_local std::vector<float> s;
  s.resize(static_cast<size_t>(rows) * S);
  // The logits as ScoreRange computes them.
  k.dense_scores_f16(sinks.key(h, 0), S, d, q, rows, s.data(), S);
  for (float& x : s) x *= scale;
  for (int i = 0; i < rows; ++i) {
    float* si = s.data() + static_cast<size_t>(i) * S;
    float mx = kNone;
    for (int t = 0; t < S; ++t) mx = std::max(mx, si[t]);
    float sum = 0.0f;
    for (int t = 0; t < S; ++t) {
      si[t] = std::exp(si[t] - mx);
      sum += si[t];
    }
    m[i] = mx;
    l[i] = sum;
  }
  std::fill(o, o + static_cast<size_t>(rows) * d, 0.0f);
  k.dense_readout_f16(sinks.value(h, 0), S, d, s.data(), S, rows, o, d);
}

absl::Status LayerCache::VerifyOnBackend(const AttendBackend& backend, int h0, int h1, int64_t b0,
                                         int64_t b1) const {
  thread_local std::vector<const uint8_t*> ptrs;
  thread_local std::vector<uint64_t> sizes;
  thread_local std::vector<uint8_t> verdicts;
  ptrs.clear();
  sizes.clear();
  for (int h = h0; h < h1; ++h)
    for (int64_t b = b0; b < b1; ++b)
      for (std::span<const uint8_t> blk : {KeyBlock(h, b), ValueBlock(h, b)}) {
        ptrs.push_back(blk.data());
        sizes.push_back(blk.size());
      }
  if (ptrs.empty()) return absl::OkStatus();
  verdicts.assign(ptrs.size(), 0xFF);
  RETURN_IF_ERROR(backend.VerifyBlocks(ptrs, sizes, verdicts.data()));
  const int64_t nb = b1 - b0;
  for (size_t i = 0; i < verdicts.size(); ++i) {
    if (verdicts[i] == kernels::cuda::kVerifyOk) continue;
    // The CPU's verdict on a copy of the block names what is wrong, as every other read does.
    const int h = h0 + static_cast<int>(i / 2 / nb);
    const int64_t b = b0 + static_cast<int64_t>(i / 2) % nb;
    const BlockReader reader(opts_, true);
    thread_local std::vector<uint8_t> copy;
    if (i % 2 == 0) {
      KeyBlockView kv;
      ASSIGN_OR_RETURN(std::span<const uint8_t> kb, CpuKeyBlock(h, b, &copy));
      RETURN_IF_ERROR(reader.Key(kb, &kv));
    } else {
      ValueBlockView vv;
      ASSIGN_OR_RETURN(std::span<const uint8_t> vb, CpuValueBlock(h, b, &copy));
      RETURN_IF_ERROR(reader.Value(vb, &vv));
    }
    return absl::DataLossError(absl::StrCat("attend backend '", backend.name(), "': block ", b,
                                            " of KV head ", h, " fails its checksum"));
  }
  return absl::OkStatus();
}

namespace {
absl::Status HeaderFlags(int flags, const AttendBackend& backend) {
  if (flags == 0) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat("attend backend '", backend.name(),
                                          "': a block's header does not match the codec"));
}
}  // namespace

const AttendBackend* LayerCache::BlocksOn() const {
  const AttendBackend* dev = block_ops_;
  if (dev == nullptr || pool_->cpu_readable() || !dev->CanRead(pool_->pool())) return nullptr;
  // The block ops read no dense-and-sparse lists: such codecs read through copies.
  if (opts_.sparse_keys > 0 || opts_.sparse_values > 0 ||
      kernels::cuda::BlockCodecUnsupported(BlockCodecOf(opts_)) != nullptr)
    return nullptr;
  return dev;
}

const AttendBackend* LayerCache::EncodesOn() const {
  // The GPU encoder has no metric rounding (sequential error feedback per token), and a codec
  // whose rank has no basis here writes no side code the way the CPU's encoder does.
  if (!tables_->rounding.empty() || !tables_->value_rounding.empty() ||
      (opts_.rank > 0 && tables_->basis_t.empty()))
    return nullptr;
  return BlocksOn();
}

absl::Status LayerCache::EncodeOnBackend(const AttendBackend& ops, int h, int64_t ready,
                                         const float* k, const float* v, const uint8_t* widths) {
  const int G = opts_.key_group, d = opts_.head_dim, r = opts_.rank;
  const format::BlockCodec codec = BlockCodecOf(opts_);
  // Each block's place, where the pool keeps it (nothing copied in): unsealed groups after the
  // head's blocks, a sealed group's key and value block after the previous heads' in its own.
  thread_local std::vector<uint8_t*> kout, vout;
  thread_local std::vector<size_t> vbytes;
  kout.resize(ready);
  vout.resize(ready);
  vbytes.resize(ready);
  size_t vtotal = 0;
  for (int64_t g = 0; g < ready; ++g) {
    vbytes[g] = ValueBlockBytes(opts_);
    if (widths != nullptr) {
      vbytes[g] = format::kHeaderBytes + format::ValueTagBytes(codec);
      for (int t = 0; t < G; ++t) vbytes[g] += format::ValueRecordBytes(codec, widths[g * G + t]);
    }
    vtotal += vbytes[g];
  }
  Head& hd = heads_[h];
  const bool seal = !building_.empty();
  const size_t k_was = hd.kblocks.size(), v_was = hd.vblocks.size(),
               offsets_was = hd.voffsets.size();
  if (seal) {
    for (int64_t g = 0; g < ready; ++g) {
      SealedBlock& sb = *building_[g];
      const size_t at = sb.bytes.size();
      kout[g] = sb.bytes.Extend(kblock_bytes_ + vbytes[g]);
      vout[g] = kout[g] + kblock_bytes_;
      sb.offsets.push_back(static_cast<uint32_t>(at + kblock_bytes_));
      sb.offsets.push_back(static_cast<uint32_t>(at + kblock_bytes_ + vbytes[g]));
    }
  } else {
    uint8_t* k0 = hd.kblocks.Extend(static_cast<size_t>(ready) * kblock_bytes_);
    uint8_t* v0 = hd.vblocks.Extend(vtotal);
    for (int64_t g = 0, at = 0; g < ready; at += vbytes[g], ++g) {
      kout[g] = k0 + g * kblock_bytes_;
      vout[g] = v0 + at;
      hd.voffsets.push_back(v_was + at);
    }
  }
  thread_local std::vector<const float*> krows, vrows, bases;
  thread_local std::vector<const uint8_t*> wrows;
  krows.resize(ready);
  vrows.resize(ready);
  wrows.resize(ready);
  const float* Ut = r > 0 ? tables_->basis_t.data() + static_cast<size_t>(h) * d * r : nullptr;
  bases.assign(ready, Ut);
  for (int64_t g = 0; g < ready; ++g) {
    krows[g] = k + static_cast<size_t>(g) * G * d;
    vrows[g] = v + static_cast<size_t>(g) * G * d;
    wrows[g] = widths != nullptr ? widths + g * G : nullptr;
  }
  kernels::cuda::EncodeKeyParams kp;
  kp.codec = codec;
  kp.blocks = static_cast<int>(ready);
  kp.keys = krows.data();
  kp.ld = d;
  kp.basis_t = Ut != nullptr ? bases.data() : nullptr;
  kp.out = kout.data();
  kernels::cuda::EncodeValueParams vp;
  vp.codec = codec;
  vp.blocks = kp.blocks;
  vp.values = vrows.data();
  vp.ld = d;
  vp.widths = widths != nullptr ? wrows.data() : nullptr;
  vp.out = vout.data();
  absl::Status st = ops.EncodeKeys(kp);
  if (st.ok()) st = ops.EncodeValues(vp);
  if (!st.ok()) {  // nothing of this call stays
    if (seal) {
      for (int64_t g = 0; g < ready; ++g) {
        SealedBlock& sb = *building_[g];
        sb.offsets.resize(sb.offsets.size() - 2);
        sb.bytes.resize(sb.offsets.back());
      }
    } else {
      hd.kblocks.resize(k_was);
      hd.vblocks.resize(v_was);
      hd.voffsets.resize(offsets_was);
    }
  }
  return st;
}

absl::Status LayerCache::ScoreOnBackend(const AttendBackend& dev, int h, const float* q,
                                        const float* uq, int rows, float scale, int64_t b0,
                                        int64_t b1, float* out, int64_t stride) const {
  if (read_.verify_checksums) RETURN_IF_ERROR(VerifyOnBackend(dev, h, h + 1, b0, b1));
  thread_local std::vector<const uint8_t*> kp;
  kp.clear();
  for (int64_t b = b0; b < b1; ++b) kp.push_back(KeyBlock(h, b).data());
  kernels::cuda::ScoreBlocksParams p;
  p.codec = BlockCodecOf(opts_);
  p.blocks = static_cast<int>(kp.size());
  p.key_blocks = kp.data();
  p.n_q = rows;
  p.q = q;
  p.uq = uq;
  p.scale = scale;
  p.out = out;
  p.out_stride = stride;
  int flags = 0;
  p.error_flags = &flags;
  RETURN_IF_ERROR(dev.ScoreBlocks(p));
  return HeaderFlags(flags, dev);
}

absl::Status LayerCache::ReadoutOnBackend(const AttendBackend& dev, int h, const float* p,
                                          int64_t stride, int rows, int64_t b0, int64_t b1,
                                          int masked, float* out) const {
  if (read_.verify_checksums) RETURN_IF_ERROR(VerifyOnBackend(dev, h, h + 1, b0, b1));
  const int G = opts_.key_group;
  thread_local std::vector<const uint8_t*> vp;
  thread_local std::vector<float> pm;
  vp.clear();
  for (int64_t b = b0; b < b1; ++b) vp.push_back(ValueBlock(h, b).data());
  if (masked > 0) {  // the first `masked` tokens get no weight (the fp16 sinks' stand-ins)
    const size_t cols = static_cast<size_t>(b1 - b0) * G;
    pm.resize(static_cast<size_t>(rows) * cols);
    for (int i = 0; i < rows; ++i) {
      std::copy_n(p + static_cast<size_t>(i) * stride, cols, pm.data() + i * cols);
      std::fill_n(pm.data() + i * cols, masked, 0.0f);
    }
    p = pm.data();
    stride = static_cast<int64_t>(cols);
  }
  kernels::cuda::ReadoutBlocksParams rp;
  rp.codec = BlockCodecOf(opts_);
  rp.blocks = static_cast<int>(vp.size());
  rp.value_blocks = vp.data();
  rp.n_q = rows;
  rp.p = p;
  rp.p_stride = stride;
  rp.out = out;
  rp.out_stride = opts_.head_dim;
  int flags = 0;
  rp.error_flags = &flags;
  RETURN_IF_ERROR(dev.ReadoutBlocks(rp));
  return HeaderFlags(flags, dev);
}

absl::Status LayerCache::DecodeOnBackend(const AttendBackend& dev, int h, int64_t b0, int64_t b1,
                                         float* k, float* v) const {
  RETURN_IF_ERROR(VerifyOnBackend(dev, h, h + 1, b0, b1));  // decodes always verify
  const int d = opts_.head_dim, G = opts_.key_group, r = opts_.rank;
  const float* U = r > 0 ? tables_->basis.data() + static_cast<size_t>(h) * d * r : nullptr;
  thread_local std::vector<const uint8_t*> kp, vp;
  thread_local std::vector<const float*> basis;
  thread_local std::vector<float*> ko, vo;
  kp.clear();
  vp.clear();
  ko.clear();
  vo.clear();
  for (int64_t b = b0; b < b1; ++b) {
    kp.push_back(KeyBlock(h, b).data());
    vp.push_back(ValueBlock(h, b).data());
    ko.push_back(k + static_cast<size_t>(b - b0) * G * d);
    vo.push_back(v + static_cast<size_t>(b - b0) * G * d);
  }
  basis.assign(kp.size(), U);
  int flags = 0;
  kernels::cuda::DecodeKeyParams kd;
  kd.codec = BlockCodecOf(opts_);
  kd.blocks = static_cast<int>(kp.size());
  kd.in = kp.data();
  kd.basis = U != nullptr ? basis.data() : nullptr;
  kd.out = ko.data();
  kd.ld = d;
  kd.error_flags = &flags;
  RETURN_IF_ERROR(dev.DecodeKeys(kd));
  kernels::cuda::DecodeValueParams vd;
  vd.codec = kd.codec;
  vd.blocks = kd.blocks;
  vd.in = vp.data();
  vd.out = vo.data();
  vd.ld = d;
  vd.error_flags = &flags;
  RETURN_IF_ERROR(dev.DecodeValues(vd));
  return HeaderFlags(flags, dev);
}

absl::Status LayerCache::AttendOnBackend(const float* q, int q_heads, int n_q,
                                         const AttendOptions& ao, float scale, float* out,
                                         bool* used) {
  *used = false;
  if (!ao.backend->CanRead(pool_->pool()))
    return absl::FailedPreconditionError(absl::StrCat("attend backend '", ao.backend->name(),
                                                      "' cannot read blocks in memory pool '",
                                                      kernels::PoolName(pool_->pool()), "'"));
  const int d = opts_.head_dim, G = opts_.key_group, r = opts_.rank;
  const int rows = q_heads / kv_heads_ * n_q;
  const int64_t nb = encoded_ / G, R = static_cast<int64_t>(q_heads) * n_q, W = tokens_ - encoded_;
  // The kernel gives every query row every block: a query that must not see an encoded token
  // reads on the CPU.
  if (nb == 0 || (ao.causal_offset >= 0 && ao.causal_offset + 1 < encoded_))
    return absl::OkStatus();
  ASSIGN_OR_RETURN(const SinkRows* sinks, ReadSinks(false));
  // A (KV head, chunk of its rows) pair per item: the kernel takes at most kAttendMaxRows rows
  // an item, padded with zero queries whose outputs are dropped.
  const int chunks = (rows + kernels::cuda::kAttendMaxRows - 1) / kernels::cuda::kAttendMaxRows;
  const int per = (rows + chunks - 1) / chunks;
  const int items = kv_heads_ * chunks;
  const size_t slots = static_cast<size_t>(items) * per;
  thread_local std::vector<const uint8_t*> kp, vp;
  thread_local std::vector<float> qb, uq, bo, bm, bs;
  kp.resize(static_cast<size_t>(items) * nb);
  vp.resize(kp.size());
  qb.assign(slots * d, 0.0f);
  uq.assign(slots * r, 0.0f);
  bo.resize(slots * d);
  bm.resize(slots);
  bs.resize(slots);
  for (int h = 0; h < kv_heads_; ++h) {
    for (int64_t b = 0; b < nb; ++b) {
      kp[static_cast<size_t>(h) * chunks * nb + b] = KeyBlock(h, b).data();
      vp[static_cast<size_t>(h) * chunks * nb + b] = ValueBlock(h, b).data();
    }
    for (int c = 1; c < chunks; ++c) {
      std::copy_n(kp.begin() + static_cast<size_t>(h) * chunks * nb, nb,
                  kp.begin() + (static_cast<size_t>(h) * chunks + c) * nb);
      std::copy_n(vp.begin() + static_cast<size_t>(h) * chunks * nb, nb,
                  vp.begin() + (static_cast<size_t>(h) * chunks + c) * nb);
    }
    const float* U = r > 0 ? tables_->basis.data() + static_cast<size_t>(h) * d * r : nullptr;
    for (int i = 0; i < rows; ++i) {
      const float* qi = q + (static_cast<size_t>(h) * rows + i) * d;
      const size_t slot = static_cast<size_t>(h) * chunks * per + i;  // item h*chunks + i/per
      std::copy_n(qi, d, qb.begin() + slot * d);
      // U^T q of the unrotated query, as ScoreRange computes it.
      if (r > 0) kernels::Active().project_queries(qi, 1, d, U, r, uq.data() + slot * r);
    }
  }
  // Rotated keys are scored with H q (the side code's U^T q stays that of q).
  if (opts_.rotate_keys) HadamardRotateRows(qb.data(), d, static_cast<int>(slots), d);

  kernels::cuda::AttendParams p;
  p.codec = BlockCodecOf(opts_);
  p.items = items;
  p.rows = per;
  p.blocks = static_cast<int>(nb);
  p.key_blocks = kp.data();
  p.value_blocks = vp.data();
  p.block_stride = nb;
  p.q = qb.data();
  p.uq = r > 0 ? uq.data() : nullptr;
  p.scale = scale;
  p.masked_prefix = sinks ? sinks->sinks : 0;
  p.out = bo.data();
  p.out_max = bm.data();
  p.out_sum = bs.data();
  int flags = 0;
  p.error_flags = &flags;
  // The kernel reads no dense-and-sparse lists: such codecs attend on the CPU kernels.
  if (nb > std::numeric_limits<int>::max() || kernels::cuda::AttendUnsupported(p) != nullptr ||
      opts_.sparse_keys > 0 || opts_.sparse_values > 0)
    return absl::OkStatus();
  // The kernel checks headers, not checksums: when the codec verifies on read, the backend
  // verifies the blocks' checksums where they lie first (docs/CODEC.md, "Attend backends").
  if (read_.verify_checksums) RETURN_IF_ERROR(VerifyOnBackend(*ao.backend, 0, kv_heads_, 0, nb));
  RETURN_IF_ERROR(ao.backend->AttendBlocks(p));
  RETURN_IF_ERROR(HeaderFlags(flags, *ao.backend));
  if (opts_.rotate_values) HadamardRotateRows(bo.data(), d, static_cast<int>(slots), d);

  // Parts: 0 the backend's (the blocks), 1 the fp16 sinks, 2 the window.
  constexpr int P = 3;
  thread_local std::vector<float> m, l, o, wp;
  m.assign(P * R, kNone);
  l.assign(P * R, 0.0f);
  o.assign(static_cast<size_t>(P) * R * d, 0.0f);
  for (int h = 0; h < kv_heads_; ++h) {
    const size_t r0 = static_cast<size_t>(h) * rows;
    for (int i = 0; i < rows; ++i) {
      const size_t slot = static_cast<size_t>(h) * chunks * per + i;
      m[r0 + i] = bm[slot];
      l[r0 + i] = bs[slot];
      for (int c = 0; c < d; ++c) o[(r0 + i) * d + c] = bo[slot * d + c] * bs[slot];
    }
    if (sinks)
      SinkPartial(*sinks, h, q + r0 * d, rows, scale, m.data() + R + r0, l.data() + R + r0,
                  o.data() + (R + r0) * d);
  }
  const bool observe = ao.observe && W > 0;
  if (W > 0) {
    if (observe) wp.assign(R * W, 0.0f);
    RETURN_IF_ERROR(AttendPart(q, q_heads, n_q, ao, scale, {encoded_, tokens_}, 0, m.data() + 2 * R,
                               l.data() + 2 * R, o.data() + 2 * R * d,
                               observe ? wp.data() : nullptr));
  }
  MergePartials(m.data(), l.data(), o.data(), P, R, d, out);
  if (observe) RecordWindowWeights(m.data(), l.data(), P, R, n_q, ao, wp.data());
  *used = true;
  return absl::OkStatus();
}

}  // namespace kvq::core
