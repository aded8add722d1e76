// Non-uniform code books (KVQuant's "nuq") inside kvq's quantization groups, for the
// evaluation lever `nuq`: each group is still coded between its min and max (the codec's own
// zero and scale), but its 2^b levels sit where calibration values fall instead of evenly.
//
// A code book is the levels 0 = c_0 < c_1 < ... < c_{L-1} = 1 on the unit interval (an
// element's place u = (x - min) / (max - min) in its group; the group's min and max land on
// the fixed ends). Companding u through the piecewise-linear map c_k -> k / (L - 1) and
// letting the uniform codec round turns its nearest-level rounding into nearest-code-book-level
// rounding (the map sends the midpoint between two levels to the midpoint between two codes),
// and expanding the decoded value maps the code back to its level: the codec's bytes, bits and
// kernels stay as they are, and only the per-layer books (L - 2 numbers) are new.
#pragma once

#include <cstdint>
#include <vector>

namespace kvq::frontend {

// Counts of u over [0, 1] in equal bins (the ends u = 0 and u = 1, which the fixed levels
// code exactly, are not counted).
struct UnitHistogram {
  static constexpr int kBins = 4096;
  std::vector<double> count = std::vector<double>(kBins, 0.0);
  void Add(double u);
  void Merge(const UnitHistogram& o);
  double total() const;
};

// Lloyd's algorithm with the ends fixed: the `levels` (2^bits, ends included) minimizing the
// mean squared distance of the histogram's mass to its nearest level. Uniform levels when the
// histogram is empty.
std::vector<float> FitCodeBook(const UnitHistogram& h, int bits);

// The piecewise-linear map of u in [0, 1] from the book's levels to evenly spaced codes, and
// its inverse. Both are monotone and fix 0 and 1.
float Compand(float u, const std::vector<float>& levels);
float Expand(float y, const std::vector<float>& levels);

// The books of a model: per layer, keys' and values' levels (empty: that tensor uniform).
struct CodeBooks {
  std::vector<std::vector<float>> keys, values;
};

}  // namespace kvq::frontend
