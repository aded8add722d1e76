#include "core/src/codec/sparse_list.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "kvq/core/half.h"
#include "kvq/core/outliers.h"

namespace kvq::core::sparse {

namespace {

struct Entry {
  int pos;
  float delta;
};
Entry At(const uint8_t* list, int e) {
  uint16_t f[2];
  std::memcpy(f, list + format::kSparseEntryBytes * e, 4);
  return {f[0], HalfToFloat(f[1])};
}

}  // namespace

Chosen Choose(const CodecOptions& o, bool keys, int n, int skip, float* x) {
  const int G = o.key_group, d = o.head_dim;
  std::vector<std::vector<int64_t>> units;
  if (keys) {
    for (int c = 0; c < d; ++c) {
      std::vector<int64_t>& u = units.emplace_back();
      for (int t = skip; t < G; ++t) u.push_back(static_cast<int64_t>(t) * d + c);
    }
  } else {
    for (int t = skip; t < G; ++t)
      for (int c0 = 0; c0 < d; c0 += o.value_group) {
        std::vector<int64_t>& u = units.emplace_back();
        for (int c = c0; c < std::min(d, c0 + o.value_group); ++c)
          u.push_back(static_cast<int64_t>(t) * d + c);
      }
  }
  const std::vector<float> before(x, x + static_cast<size_t>(G) * d);
  Chosen chosen;
  chosen.index = TrimOutliers(x, units, n);
  std::sort(chosen.index.begin(), chosen.index.end());
  for (int64_t i : chosen.index) chosen.exact.push_back(before[i]);
  return chosen;
}

void WriteList(const Chosen& chosen, const float* decoded, int n, uint8_t* list) {
  std::memset(list, 0, static_cast<size_t>(n) * format::kSparseEntryBytes);
  for (size_t e = 0; e < chosen.index.size() && e < static_cast<size_t>(n); ++e) {
    const uint16_t f[2] = {static_cast<uint16_t>(chosen.index[e]),
                           FloatToHalf(chosen.exact[e] - decoded[chosen.index[e]])};
    std::memcpy(list + format::kSparseEntryBytes * e, f, 4);
  }
}

bool ListValid(const uint8_t* list, int n, int G, int d) {
  for (int e = 0; e < n; ++e)
    if (At(list, e).pos >= G * d) return false;
  return true;
}

void AddToRows(const uint8_t* list, int n, int G, int d, float* rows, int64_t ld) {
  for (int e = 0; e < n; ++e) {
    const Entry x = At(list, e);
    if (x.pos >= G * d) continue;
    rows[(x.pos / d) * ld + x.pos % d] += x.delta;
  }
}

void AddToScores(const uint8_t* list, int n, int G, int d, const float* q, int n_q, float scale,
                 float* out, int64_t out_stride) {
  for (int e = 0; e < n; ++e) {
    const Entry x = At(list, e);
    if (x.pos >= G * d || x.delta == 0.0f) continue;
    const int t = x.pos / d, c = x.pos % d;
    for (int i = 0; i < n_q; ++i)
      out[i * out_stride + t] += scale * (q[static_cast<int64_t>(i) * d + c] * x.delta);
  }
}

void AddToReadout(const uint8_t* list, int n, int G, int d, const float* p, int64_t p_stride,
                  int n_q, float* out, int64_t out_stride) {
  for (int e = 0; e < n; ++e) {
    const Entry x = At(list, e);
    if (x.pos >= G * d || x.delta == 0.0f) continue;
    const int t = x.pos / d, c = x.pos % d;
    for (int i = 0; i < n_q; ++i) out[i * out_stride + c] += p[i * p_stride + t] * x.delta;
  }
}

}  // namespace kvq::core::sparse
