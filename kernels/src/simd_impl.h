// The optimized kernels, written once over an ISA traits struct `Isa` (lane count W, float
// vector F, int vector I) and included by avx2.cc and avx512.cc, each compiled with its own
// -m flags. Shapes the SIMD paths do not cover fall back to the scalar building blocks.
// Internal: include only after defining `Isa`, inside an anonymous namespace.

constexpr int W = Isa::W;

// Decodes W codes of B bits starting at byte p (code 0 at bit 0) to floats.
template <int B>
inline typename Isa::F Decode(const uint8_t* p) {
  return Isa::template DecodeCodes<B>(p);
}

// w [NQ][n_ch] (already scaled), bias [NQ]: out = (acc ? out : 0) + bias + w . codes.
// Two 16-token tiles per pass (when the block allows) so that 2*NQ independent FMA chains
// hide the FMA latency; one tile otherwise.
template <int B, int NQ, int TILES>
void ScoreT(const uint8_t* codes, int n_ch, int tokens, const float* w, const float* bias,
            bool accumulate, float* out, int64_t os) {
  const int64_t rb = internal::RowBytes(tokens, B);
  for (int t0 = 0; t0 < tokens; t0 += TILES * W) {
    typename Isa::F acc[TILES][NQ];
    for (int k = 0; k < TILES; ++k)
      for (int i = 0; i < NQ; ++i)
        acc[k][i] = accumulate ? Isa::Add(Isa::Load(out + i * os + t0 + k * W), Isa::Set1(bias[i]))
                               : Isa::Set1(bias[i]);
    const uint8_t* base = codes + t0 * B / 8;
    for (int c = 0; c < n_ch; ++c) {
      typename Isa::F v[TILES];
      for (int k = 0; k < TILES; ++k) v[k] = Decode<B>(base + c * rb + k * W * B / 8);
      for (int i = 0; i < NQ; ++i) {
        const typename Isa::F wc = Isa::Set1(w[i * n_ch + c]);
        for (int k = 0; k < TILES; ++k) acc[k][i] = Isa::Fmadd(wc, v[k], acc[k][i]);
      }
    }
    for (int k = 0; k < TILES; ++k)
      for (int i = 0; i < NQ; ++i) Isa::Store(out + i * os + t0 + k * W, acc[k][i]);
  }
}

template <int B, int NQ>
void ScoreQ(const uint8_t* codes, int n_ch, int tokens, const float* w, const float* bias,
            bool accumulate, float* out, int64_t os) {
  if (tokens % (2 * W) == 0)
    ScoreT<B, NQ, 2>(codes, n_ch, tokens, w, bias, accumulate, out, os);
  else
    ScoreT<B, NQ, 1>(codes, n_ch, tokens, w, bias, accumulate, out, os);
}

template <int B>
void ScoreB(const uint8_t* codes, int n_ch, int tokens, const float* w, const float* bias, int n_q,
            bool accumulate, float* out, int64_t os) {
  for (int i0 = 0; i0 < n_q; i0 += 4) {
    const float* wi = w + i0 * n_ch;
    float* oi = out + i0 * os;
    switch (std::min(4, n_q - i0)) {
      case 1:
        ScoreQ<B, 1>(codes, n_ch, tokens, wi, bias + i0, accumulate, oi, os);
        break;
      case 2:
        ScoreQ<B, 2>(codes, n_ch, tokens, wi, bias + i0, accumulate, oi, os);
        break;
      case 3:
        ScoreQ<B, 3>(codes, n_ch, tokens, wi, bias + i0, accumulate, oi, os);
        break;
      default:
        ScoreQ<B, 4>(codes, n_ch, tokens, wi, bias + i0, accumulate, oi, os);
        break;
    }
  }
}

void ScoreBits(const uint8_t* codes, int bits, int n_ch, int tokens, const float* w,
               const float* bias, int n_q, bool accumulate, float* out, int64_t os) {
  switch (bits) {
    case 1:
      return ScoreB<1>(codes, n_ch, tokens, w, bias, n_q, accumulate, out, os);
    case 2:
      return ScoreB<2>(codes, n_ch, tokens, w, bias, n_q, accumulate, out, os);
    case 3:
      return ScoreB<3>(codes, n_ch, tokens, w, bias, n_q, accumulate, out, os);
    case 4:
      return ScoreB<4>(codes, n_ch, tokens, w, bias, n_q, accumulate, out, os);
    default:
      return ScoreB<8>(codes, n_ch, tokens, w, bias, n_q, accumulate, out, os);
  }
}

constexpr int kSmallWeights = 8 * 512;  // floats: 16 KiB

// 2- and 3-bit codes go through int16 dot products where the ISA offers them (Isa::kPairDot) and
// this CPU has them: half the multiply-adds and decode instructions of the fp32 loops.
inline bool PairDot() {
  static const bool ok = internal::CpuHasPairDot();
  return ok;
}

void score_codes_simd(const uint8_t* codes, int bits, int n_ch, int tokens, const uint16_t* scale,
                      const uint16_t* zero, const float* q, int64_t qs, int n_q, float mult,
                      bool accumulate, float* out, int64_t os) {
  if (tokens % W != 0 || n_ch > 512)
    return Ref().score_codes(codes, bits, n_ch, tokens, scale, zero, q, qs, n_q, mult, accumulate,
                             out, os);
  if (n_q > 64) {  // many queries (prefill chunks): blocks of 64
    for (int i0 = 0; i0 < n_q; i0 += 64)
      score_codes_simd(codes, bits, n_ch, tokens, scale, zero, q + i0 * qs, qs,
                       std::min(64, n_q - i0), mult, accumulate, out + i0 * os, os);
    return;
  }
  if constexpr (Isa::kPairDot) {
    if ((bits == 2 || bits == 3) && n_ch % 2 == 0 && tokens % 16 == 0 && PairDot())
      return internal::ScorePairDot(codes, bits, n_ch, tokens, scale, zero, q, qs, n_q, mult,
                                    accumulate, out, os);
  }
  if (n_ch == 4 && bits == 8 && qs == 4 &&
      Isa::ScoreSide4x8(codes, tokens, scale, zero, q, n_q, mult, accumulate, out, os))
    return;
  if (n_ch < W) {  // the HeadQ side code (r channels): plain loops, no vector reductions
    float sc[W], ze[W], w[64 * W], bias[64];
    for (int c = 0; c < n_ch; ++c) {
      sc[c] = internal::HalfToFloat(scale[c]);
      ze[c] = internal::HalfToFloat(zero[c]);
    }
    for (int i = 0; i < n_q; ++i) {
      float b = 0.0f;
      for (int c = 0; c < n_ch; ++c) {
        const float qc = q[i * qs + c];
        w[i * n_ch + c] = qc * sc[c] * mult;
        b += qc * ze[c];
      }
      bias[i] = b * mult;
    }
    return ScoreBits(codes, bits, n_ch, tokens, w, bias, n_q, accumulate, out, os);
  }
  // Per query: w_c = mult * q_c * scale_c and bias = mult * q . zero, once per block. The
  // weights of small calls (every decode-time block) live on the stack.
  alignas(64) float sc[512], ze[512];
  alignas(64) float w_small[kSmallWeights];
  float* w = w_small;
  if (static_cast<int64_t>(n_q) * n_ch > kSmallWeights) {
    thread_local std::vector<float> w_big;  // grown only
    if (w_big.size() < static_cast<size_t>(n_q) * n_ch)
      w_big.resize(static_cast<size_t>(n_q) * n_ch);
    w = w_big.data();
  }
  float bias[64];
  int c = 0;
  for (; c + W <= n_ch; c += W) {
    Isa::Store(sc + c, Isa::LoadHalf(scale + c));
    Isa::Store(ze + c, Isa::LoadHalf(zero + c));
  }
  for (; c < n_ch; ++c) {
    sc[c] = internal::HalfToFloat(scale[c]);
    ze[c] = internal::HalfToFloat(zero[c]);
  }
  const int full = n_ch / W * W;
  const typename Isa::F m = Isa::Set1(mult);
  for (int i0 = 0; i0 < n_q; i0 += 4) {  // the bias sums of four queries reduced together
    typename Isa::F b[4] = {Isa::Zero(), Isa::Zero(), Isa::Zero(), Isa::Zero()};
    const int n4 = std::min(4, n_q - i0);
    for (int j = 0; j < n4; ++j) {
      const float* qi = q + (i0 + j) * qs;
      float* wi = w + static_cast<size_t>(i0 + j) * n_ch;
      for (int k = 0; k < full; k += W) {
        const typename Isa::F qv = Isa::Load(qi + k);
        Isa::Store(wi + k, Isa::Mul(Isa::Mul(qv, Isa::Load(sc + k)), m));
        b[j] = Isa::Fmadd(qv, Isa::Load(ze + k), b[j]);
      }
    }
    float bs[4];
    Isa::ReduceAdd4(b, bs);
    for (int j = 0; j < n4; ++j) {
      const float* qi = q + (i0 + j) * qs;
      float* wi = w + static_cast<size_t>(i0 + j) * n_ch;
      for (int k = full; k < n_ch; ++k) {
        wi[k] = qi[k] * sc[k] * mult;
        bs[j] += qi[k] * ze[k];
      }
      bias[i0 + j] = bs[j] * mult;
    }
  }
  ScoreBits(codes, bits, n_ch, tokens, w, bias, n_q, accumulate, out, os);
}

// Readout over a block of token records. Per-token scales and zero points are turned into
// per-(query, group, token) coefficients first; then, channel chunk by channel chunk, the
// tokens are accumulated in registers (NQ accumulators), so no store/load chains per token.
constexpr int kMaxRows = 128, kMaxGroups = 8;

struct RowTable {
  alignas(64) int32_t rec[kMaxRows];  // byte offset of each token's record (scales first)
  uint32_t off[kMaxRows];             // byte offset of each token's codes
  uint8_t bits[kMaxRows];
  bool uniform;
  // hz[g][t] = scale of group g of token t, hz[ng + g][t] its zero point, as floats: converted
  // once per call for every query.
  alignas(64) float hz[2 * kMaxGroups][kMaxRows];
};

// Fills rt->hz from the records' fp16 headers. Up to 4 groups, each token's header is copied
// into a slot of 8 halves and W slots are transposed by the ISA at once (no gathers).
inline void LoadRowHeaders(const uint8_t* rows, int n_rows, int ng, RowTable* rt) {
  int t = 0;
  if (ng <= 4) {
    alignas(64) uint16_t slot[kMaxRows][8];
    for (int u = 0; u < n_rows; ++u) {
      const uint8_t* h = rows + rt->rec[u];
      switch (ng) {  // constant sizes: plain moves
        case 1:
          std::memcpy(slot[u], h, 4);
          break;
        case 2:
          std::memcpy(slot[u], h, 8);
          break;
        case 3:
          std::memcpy(slot[u], h, 12);
          break;
        default:
          std::memcpy(slot[u], h, 16);
          break;
      }
    }
    for (; t + W <= n_rows; t += W) Isa::SlotsToFloats(slot + t, 2 * ng, &rt->hz[0][t], kMaxRows);
  }
  for (; t < n_rows; ++t) {  // records may sit at odd addresses: copied out, never cast
    uint16_t h[2 * kMaxGroups];
    std::memcpy(h, rows + rt->rec[t], 4 * ng);
    for (int k = 0; k < 2 * ng; ++k) rt->hz[k][t] = internal::HalfToFloat(h[k]);
  }
}

// CH consecutive channel chunks per pass (CH = 2 gives 2*NQ independent FMA chains).
template <int B, int NQ, int CH>
inline void ReadoutChunkUniform(const uint8_t* rows, const RowTable& rt, int n_rows, int ch,
                                const float* const* coef, typename Isa::F (*acc)[NQ]) {
  for (int t = 0; t < n_rows; ++t) {
    typename Isa::F v[CH];
    for (int k = 0; k < CH; ++k) v[k] = Decode<B>(rows + rt.off[t] + (ch + k) * W * B / 8);
    for (int i = 0; i < NQ; ++i)
      for (int k = 0; k < CH; ++k)
        acc[k][i] = Isa::Fmadd(Isa::Set1(coef[k][i * kMaxGroups * kMaxRows + t]), v[k], acc[k][i]);
  }
}

// ReadoutChunkUniform with the code width given at run time (1, 2, 3, 4; anything else 8).
template <int NQ, int CH>
inline void ReadoutChunkUniformOfWidth(int bits, const uint8_t* rows, const RowTable& rt,
                                       int n_rows, int ch, const float* const* coef,
                                       typename Isa::F (*acc)[NQ]) {
  switch (bits) {
    case 1:
      return ReadoutChunkUniform<1, NQ, CH>(rows, rt, n_rows, ch, coef, acc);
    case 2:
      return ReadoutChunkUniform<2, NQ, CH>(rows, rt, n_rows, ch, coef, acc);
    case 3:
      return ReadoutChunkUniform<3, NQ, CH>(rows, rt, n_rows, ch, coef, acc);
    case 4:
      return ReadoutChunkUniform<4, NQ, CH>(rows, rt, n_rows, ch, coef, acc);
    default:
      return ReadoutChunkUniform<8, NQ, CH>(rows, rt, n_rows, ch, coef, acc);
  }
}

template <int NQ>
inline void ReadoutChunkMixed(const uint8_t* rows, const RowTable& rt, int n_rows, int ch,
                              const float* coef, typename Isa::F* acc) {
  for (int t = 0; t < n_rows; ++t) {
    const int b = rt.bits[t];
    const uint8_t* c = rows + rt.off[t] + ch * W * b / 8;
    typename Isa::F v;
    switch (b) {
      case 1:
        v = Decode<1>(c);
        break;
      case 2:
        v = Decode<2>(c);
        break;
      case 3:
        v = Decode<3>(c);
        break;
      case 4:
        v = Decode<4>(c);
        break;
      default:
        v = Decode<8>(c);
        break;
    }
    for (int i = 0; i < NQ; ++i)
      acc[i] = Isa::Fmadd(Isa::Set1(coef[i * kMaxGroups * kMaxRows + t]), v, acc[i]);
  }
}

template <int NQ>
void ReadoutT(const uint8_t* rows, const RowTable& rt, int n_rows, int n, int group, int ng,
              const float* p, int64_t ps, float* out, int64_t os) {
  // coef[i][g][t] = p_i[t] * scale[t][g]; zsum[i][g] = sum_t p_i[t] * zero[t][g]. Scales and
  // zero points of W tokens are gathered from their records at once.
  alignas(64) float coef[NQ * kMaxGroups * kMaxRows];
  float zsum[NQ * kMaxGroups + 4] = {};
  // Zero-point sums stay vectors over the tokens, reduced four at a time at the end.
  typename Isa::F zacc[NQ * kMaxGroups + 4];
  for (int k = 0; k < NQ * ng; ++k) zacc[k] = Isa::Zero();
  int t = 0;
  for (; t + W <= n_rows; t += W) {
    for (int g = 0; g < ng; ++g) {
      const typename Isa::F sc = Isa::Load(&rt.hz[g][t]), ze = Isa::Load(&rt.hz[ng + g][t]);
      for (int i = 0; i < NQ; ++i) {
        const typename Isa::F pv = Isa::Load(p + i * ps + t);
        Isa::Store(coef + (i * kMaxGroups + g) * kMaxRows + t, Isa::Mul(pv, sc));
        zacc[i * ng + g] = Isa::Fmadd(pv, ze, zacc[i * ng + g]);
      }
    }
  }
  if (t > 0) {
    for (int k = NQ * ng; k % 4 != 0; ++k) zacc[k] = Isa::Zero();
    float zs[NQ * kMaxGroups + 4];
    for (int k = 0; k < NQ * ng; k += 4) Isa::ReduceAdd4(zacc + k, zs + k);
    for (int i = 0; i < NQ; ++i)
      for (int g = 0; g < ng; ++g) zsum[i * kMaxGroups + g] = zs[i * ng + g];
  }
  for (; t < n_rows; ++t) {
    for (int g = 0; g < ng; ++g) {
      const float sc = rt.hz[g][t], ze = rt.hz[ng + g][t];
      for (int i = 0; i < NQ; ++i) {
        const float pt = p[i * ps + t];
        coef[(i * kMaxGroups + g) * kMaxRows + t] = pt * sc;
        zsum[i * kMaxGroups + g] += pt * ze;
      }
    }
  }
  const int chunks = n / W;
  for (int ch = 0; ch < chunks;) {
    const bool pair = rt.uniform && ch + 1 < chunks;
    const int nc = pair ? 2 : 1;
    typename Isa::F acc[2][NQ];
    for (int k = 0; k < 2; ++k)
      for (int i = 0; i < NQ; ++i) acc[k][i] = Isa::Zero();
    const float* cg[2] = {coef + (ch * W / group) * kMaxRows,
                          coef + ((pair ? ch + 1 : ch) * W / group) * kMaxRows};
    if (!rt.uniform) {
      ReadoutChunkMixed<NQ>(rows, rt, n_rows, ch, cg[0], acc[0]);
    } else if (pair) {
      ReadoutChunkUniformOfWidth<NQ, 2>(rt.bits[0], rows, rt, n_rows, ch, cg, acc);
    } else {
      ReadoutChunkUniformOfWidth<NQ, 1>(rt.bits[0], rows, rt, n_rows, ch, cg, acc);
    }
    for (int k = 0; k < nc; ++k) {
      const int g = (ch + k) * W / group;
      for (int i = 0; i < NQ; ++i) {
        float* o = out + i * os + (ch + k) * W;
        Isa::Store(
            o, Isa::Add(Isa::Load(o), Isa::Add(acc[k][i], Isa::Set1(zsum[i * kMaxGroups + g]))));
      }
    }
    ch += nc;
  }
}

void readout_rows_simd(const uint8_t* rows, const uint8_t* row_bits, int n_rows, int n, int group,
                       const float* p, int64_t ps, int n_q, float* out, int64_t os) {
  const int ng = (n + group - 1) / group;
  if (n_rows <= 0) return;
  if (n % W != 0 || group % W != 0 || ng > kMaxGroups || n_rows > kMaxRows)
    return Ref().readout_rows(rows, row_bits, n_rows, n, group, p, ps, n_q, out, os);
  const bool uniform = std::memcmp(row_bits, row_bits + 1, n_rows - 1) == 0;  // all widths equal
  if constexpr (Isa::kPairDot) {
    const int bits = row_bits[0];
    const int64_t rec = 4 * ng + internal::RowBytes(n, bits);
    if (uniform && (bits == 2 || bits == 3) && ng <= 4 && rec >= 16 && PairDot())
      return internal::ReadoutPairDot(rows, bits, rec, n_rows, n, group, p, ps, n_q, out, os);
  }
  thread_local RowTable rt;  // 9 KiB: kept off small worker stacks
  rt.uniform = uniform;
  if (rt.uniform) {  // fixed-size records: offsets are an arithmetic progression
    const int32_t rec = 4 * ng + static_cast<int32_t>(internal::RowBytes(n, row_bits[0]));
    for (int t = 0; t < n_rows; ++t) {
      rt.rec[t] = t * rec;
      rt.off[t] = static_cast<uint32_t>(t * rec + 4 * ng);
      rt.bits[t] = row_bits[0];
    }
  } else {
    uint32_t off = 0;
    for (int t = 0; t < n_rows; ++t) {
      rt.bits[t] = row_bits[t];
      rt.rec[t] = static_cast<int32_t>(off);
      off += 4 * ng;
      rt.off[t] = off;
      off += static_cast<uint32_t>(internal::RowBytes(n, row_bits[t]));
    }
  }
  LoadRowHeaders(rows, n_rows, ng, &rt);
  for (int i0 = 0; i0 < n_q; i0 += 4) {
    const float* pi = p + i0 * ps;
    float* oi = out + i0 * os;
    switch (std::min(4, n_q - i0)) {
      case 1:
        ReadoutT<1>(rows, rt, n_rows, n, group, ng, pi, ps, oi, os);
        break;
      case 2:
        ReadoutT<2>(rows, rt, n_rows, n, group, ng, pi, ps, oi, os);
        break;
      case 3:
        ReadoutT<3>(rows, rt, n_rows, n, group, ng, pi, ps, oi, os);
        break;
      default:
        ReadoutT<4>(rows, rt, n_rows, n, group, ng, pi, ps, oi, os);
        break;
    }
  }
}

// Per-channel quantization over tokens, W channels per vector. Codes are accumulated into
// 64-bit words per channel (little-endian bit order, as internal::PutCode writes them) and
// written to the channel-major rows; a code that crosses a word boundary (B = 3) continues in
// the next word, and a last partial word writes only the row's remaining bytes.
template <int B>
void QuantizeChannelsB(const float* x, int64_t ld, int tokens, int n_ch, uint16_t* scale,
                       uint16_t* zero, uint8_t* codes, float* deq) {
  const int64_t rb = internal::RowBytes(tokens, B);
  const int full = n_ch / W * W;
  for (int c0 = 0; c0 < full; c0 += W) {
    // Two chains (min and max are exact in any order) to halve the latency-bound loop.
    typename Isa::F lo = Isa::Load(x + c0), hi = lo, lo2 = lo, hi2 = lo;
    int t = 1;
    for (; t + 1 < tokens; t += 2) {
      const typename Isa::F v = Isa::Load(x + t * ld + c0), v2 = Isa::Load(x + (t + 1) * ld + c0);
      lo = Isa::Min(lo, v);
      hi = Isa::Max(hi, v);
      lo2 = Isa::Min(lo2, v2);
      hi2 = Isa::Max(hi2, v2);
    }
    for (; t < tokens; ++t) {
      const typename Isa::F v = Isa::Load(x + t * ld + c0);
      lo = Isa::Min(lo, v);
      hi = Isa::Max(hi, v);
    }
    lo = Isa::Min(lo, lo2);
    hi = Isa::Max(hi, hi2);
    typename Isa::F zv, iv, sv;
    Isa::MakeParams(lo, hi, B, scale + c0, zero + c0, &sv, &zv, &iv);
    typename Isa::Words words;
    Isa::ClearWords(&words);
    alignas(64) uint64_t wv[W];
    internal::PrefetchAhead& ahead = internal::Ahead();  // PrefetchWhileEncoding
    for (int t = 0; t < tokens; ++t) {
      ahead.Some(1);
      typename Isa::I q = Isa::QuantizeLanes(Isa::Load(x + t * ld + c0), zv, iv, (1 << B) - 1);
      if (deq)
        Isa::Store(deq + static_cast<int64_t>(t) * n_ch + c0, Isa::Fmadd(Isa::CvtI(q), sv, zv));
      const int bit = (t * B) % 64;
      Isa::OrIntoWords(&words, q, bit);
      if (bit + B >= 64) {  // the word is full
        Isa::StoreWords(&words, wv);
        const int64_t off = (static_cast<int64_t>(t) * B / 64) * 8;
        for (int j = 0; j < W; ++j) std::memcpy(codes + (c0 + j) * rb + off, &wv[j], 8);
        Isa::ClearWords(&words);
        if (bit + B > 64) Isa::OrIntoWords(&words, Isa::ShiftRight(q, 64 - bit), 0);
      }
    }
    const int64_t tail = static_cast<int64_t>(tokens) * B % 64;
    if (tail != 0) {  // a last partial word: the row's bytes after the full words
      Isa::StoreWords(&words, wv);
      const int64_t off = static_cast<int64_t>(tokens) * B / 64 * 8;
      for (int j = 0; j < W; ++j) std::memcpy(codes + (c0 + j) * rb + off, &wv[j], rb - off);
    }
  }
  if (full < n_ch)
    internal::QuantizeChannelRange(x, ld, tokens, n_ch, full, n_ch, B, scale, zero, codes, deq);
}

// Fewer channels than lanes (the HeadQ side code: x [tokens][rank], rank 4 at 4 bits): each
// channel's tokens gathered into one row, then W tokens per vector, packed as quantize_row
// packs a group. The scalar MakeParams of the reference, so the same fp16 bits. False when
// the shape is another one (deq wanted, widths PackRow lacks, tokens not whole vectors).
bool QuantizeFewChannels(const float* x, int64_t ld, int tokens, int n_ch, int bits,
                         uint16_t* scale, uint16_t* zero, uint8_t* codes, float* deq) {
  if (n_ch >= W || deq != nullptr || tokens % W != 0 || bits == 3 || bits > 8 ||
      (bits > 4 && bits != 8))
    return false;
  thread_local std::vector<float> row;
  row.resize(tokens);
  const int64_t rb = internal::RowBytes(tokens, bits);
  const int maxq = (1 << bits) - 1;
  for (int c = 0; c < n_ch; ++c) {
    for (int t = 0; t < tokens; ++t) row[t] = x[t * ld + c];
    typename Isa::F lo = Isa::Load(row.data()), hi = lo;
    for (int t = W; t < tokens; t += W) {
      lo = Isa::Min(lo, Isa::Load(row.data() + t));
      hi = Isa::Max(hi, Isa::Load(row.data() + t));
    }
    const internal::QParams p =
        internal::MakeParams(Isa::ReduceMin(lo), Isa::ReduceMax(hi), bits, &scale[c], &zero[c]);
    const typename Isa::F z = Isa::Set1(p.zero), inv = Isa::Set1(p.inv);
    uint8_t* out = codes + c * rb;
    for (int t = 0; t < tokens; t += W)
      Isa::PackRow(Isa::QuantizeLanes(Isa::Load(row.data() + t), z, inv, maxq), bits,
                   out + t * bits / 8);
  }
  return true;
}

void quantize_channels_simd(const float* x, int64_t ld, int tokens, int n_ch, int bits,
                            uint16_t* scale, uint16_t* zero, uint8_t* codes, float* deq) {
  if (bits == 8 && deq == nullptr &&
      Isa::QuantizeChannels4x8(x, ld, tokens, n_ch, scale, zero, codes))
    return;
  if (QuantizeFewChannels(x, ld, tokens, n_ch, bits, scale, zero, codes, deq)) return;
  std::memset(codes, 0, internal::RowBytes(tokens, bits) * n_ch);
  switch (bits) {
    case 1:
      return QuantizeChannelsB<1>(x, ld, tokens, n_ch, scale, zero, codes, deq);
    case 2:
      return QuantizeChannelsB<2>(x, ld, tokens, n_ch, scale, zero, codes, deq);
    case 3:
      return QuantizeChannelsB<3>(x, ld, tokens, n_ch, scale, zero, codes, deq);
    case 4:
      return QuantizeChannelsB<4>(x, ld, tokens, n_ch, scale, zero, codes, deq);
    default:
      return QuantizeChannelsB<8>(x, ld, tokens, n_ch, scale, zero, codes, deq);
  }
}

void quantize_row_simd(const float* x, int n, int group, int bits, uint16_t* scale, uint16_t* zero,
                       uint8_t* codes) {
  if (n % W != 0 || group % W != 0 || bits == 3)
    return internal::QuantizeRowScalar(x, n, group, bits, scale, zero, codes);
  const int ng = (n + group - 1) / group;  // the last group may be shorter (a multiple of W)
  // W groups at a time: ranges by lane, then the fp16 parameters of all of them at once.
  for (int g0 = 0; g0 < ng; g0 += W) {
    const int gn = std::min(W, ng - g0);
    alignas(64) float lov[W] = {}, hiv[W] = {}, zf[W], invf[W];
    for (int g = 0; g < gn; ++g) {
      const float* xg = x + (g0 + g) * group;
      const int len = std::min(group, n - (g0 + g) * group);
      typename Isa::F lo = Isa::Load(xg), hi = lo;
      for (int c = W; c < len; c += W) {
        lo = Isa::Min(lo, Isa::Load(xg + c));
        hi = Isa::Max(hi, Isa::Load(xg + c));
      }
      lov[g] = Isa::ReduceMin(lo);
      hiv[g] = Isa::ReduceMax(hi);
    }
    alignas(64) uint16_t s16[W], z16[W];
    typename Isa::F sv, zv, iv;
    Isa::MakeParams(Isa::Load(lov), Isa::Load(hiv), bits, s16, z16, &sv, &zv, &iv);
    std::memcpy(scale + g0, s16, 2 * gn);
    std::memcpy(zero + g0, z16, 2 * gn);
    Isa::Store(zf, zv);
    Isa::Store(invf, iv);
    for (int g = 0; g < gn; ++g) {
      const int c0 = (g0 + g) * group, c1 = std::min(n, c0 + group);
      const typename Isa::F z = Isa::Set1(zf[g]), inv = Isa::Set1(invf[g]);
      for (int c = c0; c < c1; c += W)
        Isa::PackRow(Isa::QuantizeLanes(Isa::Load(x + c), z, inv, (1 << bits) - 1), bits,
                     codes + c * bits / 8);
    }
  }
}

// W rows at a time: the group ranges of all W rows are reduced together (lane t = row t),
// so the fp16 parameters of W rows come from one vector MakeParams per group.
constexpr int kMaxRowGroups = 8;

void QuantizeRowsW(const float* x, int64_t ld, int n, int group, int ng, int bits, uint8_t* rec,
                   int64_t rec_bytes) {
  alignas(64) float zf[kMaxRowGroups][W], invf[kMaxRowGroups][W];
  for (int g = 0; g < ng; ++g) {
    const int c0 = g * group, len = std::min(group, n - c0);
    typename Isa::F lo[W], hi[W];
    for (int t = 0; t < W; ++t) {
      const float* xt = x + t * ld + c0;
      lo[t] = hi[t] = Isa::Load(xt);
      for (int c = W; c < len; c += W) {
        lo[t] = Isa::Min(lo[t], Isa::Load(xt + c));
        hi[t] = Isa::Max(hi[t], Isa::Load(xt + c));
      }
    }
    alignas(64) uint16_t s16[W], z16[W];
    typename Isa::F sv, zv, iv;
    Isa::MakeParams(Isa::TransposeMin(lo), Isa::TransposeMax(hi), bits, s16, z16, &sv, &zv, &iv);
    Isa::Store(zf[g], zv);
    Isa::Store(invf[g], iv);
    for (int t = 0; t < W; ++t) {
      std::memcpy(rec + t * rec_bytes + 2 * g, &s16[t], 2);
      std::memcpy(rec + t * rec_bytes + 2 * (ng + g), &z16[t], 2);
    }
  }
  const int maxq = (1 << bits) - 1;
  internal::PrefetchAhead& ahead = internal::Ahead();  // PrefetchWhileEncoding: an fp16 row
  const int lines = std::max(1, n / 32);               // of n per token
  if (Isa::kPack64x2 && bits == 2 && n % 64 == 0) {
    for (int t = 0; t < W; ++t) {
      ahead.Some(lines);
      const float* xt = x + t * ld;
      uint8_t* codes = rec + t * rec_bytes + 4 * ng;
      for (int c0 = 0; c0 < n; c0 += 64) {
        typename Isa::I q[4];
        for (int k = 0; k < 4; ++k) {
          const int c = c0 + k * W, g = c / group;
          q[k] =
              Isa::QuantizeLanes(Isa::Load(xt + c), Isa::Set1(zf[g][t]), Isa::Set1(invf[g][t]), 3);
        }
        Isa::Pack64x2(q, codes + c0 / 4);
      }
    }
    return;
  }
  for (int t = 0; t < W; ++t) {
    ahead.Some(lines);
    const float* xt = x + t * ld;
    uint8_t* codes = rec + t * rec_bytes + 4 * ng;
    for (int c = 0; c < n; c += W) {
      const int g = c / group;
      Isa::PackRow(
          Isa::QuantizeLanes(Isa::Load(xt + c), Isa::Set1(zf[g][t]), Isa::Set1(invf[g][t]), maxq),
          bits, codes + c * bits / 8);
    }
  }
}

void quantize_rows_simd(const float* x, int64_t ld, int n_rows, int n, int group, int bits,
                        uint8_t* rec, int64_t rec_bytes) {
  const int ng = (n + group - 1) / group;
  int t = 0;
  if (n % W == 0 && group % W == 0 && bits != 3 && ng <= kMaxRowGroups)
    for (; t + W <= n_rows; t += W)
      QuantizeRowsW(x + t * ld, ld, n, group, ng, bits, rec + t * rec_bytes, rec_bytes);
  // A record of odd size puts the next one's fp16 fields at an odd address: written through
  // an aligned copy.
  uint16_t s[2 * 64];  // ng <= 64 (CodecOptions::Validate)
  for (; t < n_rows; ++t) {
    quantize_row_simd(x + t * ld, n, group, bits, s, s + ng, rec + t * rec_bytes + 4 * ng);
    std::memcpy(rec + t * rec_bytes, s, 4 * ng);
  }
}

template <typename T>
inline typename Isa::F LoadRow(const T* p) {
  if constexpr (sizeof(T) == 2)
    return Isa::LoadHalf(p);
  else
    return Isa::Load(p);
}

// NQ accumulators in registers (compile-time count; `nq` <= NQ used for the 5..8 case).
template <typename T, int NQ>
void DenseScoresT(const T* k, int tokens, int d, const float* q, float* out, int64_t os,
                  int nq = NQ) {
  for (int t = 0; t < tokens; ++t) {
    const T* kr = k + static_cast<int64_t>(t) * d;
    typename Isa::F acc[NQ];
    for (int i = 0; i < NQ; ++i) acc[i] = Isa::Zero();
    for (int c = 0; c < d; c += W) {
      const typename Isa::F kv = LoadRow(kr + c);
      for (int i = 0; i < NQ; ++i)
        if (i < nq) acc[i] = Isa::Fmadd(Isa::Load(q + i * d + c), kv, acc[i]);
    }
    for (int i = 0; i < nq; ++i) out[i * os + t] = Isa::ReduceAdd(acc[i]);
  }
}

template <typename T>
void DenseScores(const T* k, int tokens, int d, const float* q, int n_q, float* out, int64_t os) {
  for (int i0 = 0; i0 < n_q; i0 += 8) {
    switch (std::min(8, n_q - i0)) {
      case 1:
        DenseScoresT<T, 1>(k, tokens, d, q + i0 * d, out + i0 * os, os);
        break;
      case 2:
        DenseScoresT<T, 2>(k, tokens, d, q + i0 * d, out + i0 * os, os);
        break;
      case 3:
        DenseScoresT<T, 3>(k, tokens, d, q + i0 * d, out + i0 * os, os);
        break;
      case 4:
        DenseScoresT<T, 4>(k, tokens, d, q + i0 * d, out + i0 * os, os);
        break;
      default:
        DenseScoresT<T, 8>(k, tokens, d, q + i0 * d, out + i0 * os, os, std::min(8, n_q - i0));
        break;
    }
  }
}

void dense_scores_f16_simd(const uint16_t* k, int tokens, int d, const float* q, int n_q,
                           float* out, int64_t os) {
  if (d % W != 0 || d > 256) return Ref().dense_scores_f16(k, tokens, d, q, n_q, out, os);
  DenseScores(k, tokens, d, q, n_q, out, os);
}

void dense_scores_f32_simd(const float* k, int tokens, int d, const float* q, int n_q, float* out,
                           int64_t os) {
  if (d % W != 0 || d > 256) return Ref().dense_scores_f32(k, tokens, d, q, n_q, out, os);
  DenseScores(k, tokens, d, q, n_q, out, os);
}

template <int NQ>
void DenseReadoutT(const uint16_t* v, int tokens, int d, const float* p, int64_t ps, float* out,
                   int64_t os) {
  constexpr int kTile = 64;  // tokens per tile: d * 2 * 64 bytes stay in L1
  for (int t0 = 0; t0 < tokens; t0 += kTile) {
    const int t1 = std::min(tokens, t0 + kTile);
    for (int c = 0; c < d; c += W) {
      typename Isa::F acc[NQ];  // NQ independent chains over the tile's tokens
      for (int i = 0; i < NQ; ++i) acc[i] = Isa::Load(out + i * os + c);
      for (int t = t0; t < t1; ++t) {
        const typename Isa::F x = LoadRow(v + static_cast<int64_t>(t) * d + c);
        for (int i = 0; i < NQ; ++i) acc[i] = Isa::Fmadd(Isa::Set1(p[i * ps + t]), x, acc[i]);
      }
      for (int i = 0; i < NQ; ++i) Isa::Store(out + i * os + c, acc[i]);
    }
  }
}

void DenseReadout(const uint16_t* v, int tokens, int d, const float* p, int64_t ps, int n_q,
                  float* out, int64_t os) {
  for (int i0 = 0; i0 < n_q; i0 += 4) {
    const float* pi = p + i0 * ps;
    float* oi = out + i0 * os;
    switch (std::min(4, n_q - i0)) {
      case 1:
        DenseReadoutT<1>(v, tokens, d, pi, ps, oi, os);
        break;
      case 2:
        DenseReadoutT<2>(v, tokens, d, pi, ps, oi, os);
        break;
      case 3:
        DenseReadoutT<3>(v, tokens, d, pi, ps, oi, os);
        break;
      default:
        DenseReadoutT<4>(v, tokens, d, pi, ps, oi, os);
        break;
    }
  }
}

void dense_readout_f16_simd(const uint16_t* v, int tokens, int d, const float* p, int64_t ps,
                            int n_q, float* out, int64_t os) {
  if (d % W != 0) return Ref().dense_readout_f16(v, tokens, d, p, ps, n_q, out, os);
  DenseReadout(v, tokens, d, p, ps, n_q, out, os);
}

// W tokens at a time for rank r: the r accumulators of every token are summed by r
// transposing trees (the same pairs as ReduceAdd, so the same bits) instead of r * W
// horizontal sums.
template <int R>
int ProjectResidualW(const float* x, int64_t ld, const float* deq, int tokens, int d,
                     const float* ut, float* out) {
  int t0 = 0;
  for (; t0 + W <= tokens; t0 += W) {
    typename Isa::F acc[R][W];
    for (int i = 0; i < W; ++i) {
      const float* xt = x + (t0 + i) * ld;
      const float* dt = deq + static_cast<int64_t>(t0 + i) * d;
      typename Isa::F a[R];
      for (int j = 0; j < R; ++j) a[j] = Isa::Zero();
      for (int c = 0; c < d; c += W) {
        typename Isa::F e = Isa::Sub(Isa::Load(xt + c), Isa::Load(dt + c));
        for (int j = 0; j < R; ++j) a[j] = Isa::Fmadd(e, Isa::Load(ut + j * d + c), a[j]);
      }
      for (int j = 0; j < R; ++j) acc[j][i] = a[j];
    }
    alignas(64) float sums[R][W];
    for (int j = 0; j < R; ++j) Isa::Store(sums[j], Isa::TransposeAdd(acc[j]));
    for (int i = 0; i < W; ++i)
      for (int j = 0; j < R; ++j) out[(t0 + i) * R + j] = sums[j][i];
  }
  return t0;
}

void project_residual_simd(const float* x, int64_t ld, const float* deq, int tokens, int d,
                           const float* ut, int r, float* out) {
  if (d % W != 0 || r > 16) return Ref().project_residual(x, ld, deq, tokens, d, ut, r, out);
  int t = 0;
  if (r == 4) t = ProjectResidualW<4>(x, ld, deq, tokens, d, ut, out);
  for (; t < tokens; ++t) {
    const float* xt = x + t * ld;
    const float* dt = deq + static_cast<int64_t>(t) * d;
    typename Isa::F acc[16];
    for (int j = 0; j < r; ++j) acc[j] = Isa::Zero();
    for (int c = 0; c < d; c += W) {
      typename Isa::F e = Isa::Sub(Isa::Load(xt + c), Isa::Load(dt + c));
      for (int j = 0; j < r; ++j) acc[j] = Isa::Fmadd(e, Isa::Load(ut + j * d + c), acc[j]);
    }
    for (int j = 0; j < r; ++j) out[t * r + j] = Isa::ReduceAdd(acc[j]);
  }
}

uint64_t xxh3_simd(const void* data, size_t len, uint64_t seed) {
  // Reads verify a block just before scoring it, block after block: ask for the block after
  // the next one (same-size blocks of a sequence, usually) while this one is hashed; the next
  // one was asked for by the previous call. One block ahead left ~10% of AttendCodes at d=64
  // waiting on memory. The int16 kernels request most of its lines (internal::PrefetchAhead);
  // what they left of the previous request is asked for here.
  internal::PrefetchAhead& ahead = internal::Ahead();
  ahead.Some(1 << 30);
  ahead.next = static_cast<const char*>(data) + 2 * len;
  ahead.end = ahead.next + len;
  ahead.Some(8);
  return XXH3_64bits_withSeed(data, len, seed);  // inlined with this unit's vector width
}

float exp_sum_simd(float* x, int64_t n, float shift) {
  typename Isa::F sum = Isa::Zero();
  const typename Isa::F sh = Isa::Set1(shift);
  int64_t t = 0;
  for (; t + W <= n; t += W) {
    typename Isa::F e = Isa::Exp(Isa::Sub(Isa::Load(x + t), sh));
    Isa::Store(x + t, e);
    sum = Isa::Add(sum, e);
  }
  float s = Isa::ReduceAdd(sum);
  for (; t < n; ++t) {
    x[t] = std::exp(x[t] - shift);
    s += x[t];
  }
  return s;
}

void softmax_simd(float* x, int64_t n) {
  typename Isa::F m = Isa::Set1(x[0]);
  int64_t t = 0;
  for (; t + W <= n; t += W) m = Isa::Max(m, Isa::Load(x + t));
  float mx = Isa::ReduceMax(m);
  for (; t < n; ++t) mx = std::max(mx, x[t]);
  const float inv = 1.0f / exp_sum_simd(x, n, mx);
  const typename Isa::F iv = Isa::Set1(inv);
  for (t = 0; t + W <= n; t += W) Isa::Store(x + t, Isa::Mul(Isa::Load(x + t), iv));
  for (; t < n; ++t) x[t] *= inv;
}

float max_value_simd(const float* x, int64_t n) {
  typename Isa::F m = Isa::Set1(x[0]);
  int64_t t = 0;
  for (; t + W <= n; t += W) m = Isa::Max(m, Isa::Load(x + t));
  float mx = Isa::ReduceMax(m);
  for (; t < n; ++t) mx = std::max(mx, x[t]);
  return mx;
}

// A W x W tile at a time: W channel rows of W tokens decoded and scaled (one vector per
// channel), transposed in registers, stored as W token rows of W channels.
template <int B>
void DequantizeChannelsB(const uint8_t* codes, int n_ch, int tokens, const uint16_t* scale,
                         const uint16_t* zero, float* out, int64_t ld) {
  const int64_t rb = internal::RowBytes(tokens, B);
  for (int c0 = 0; c0 + W <= n_ch; c0 += W) {
    float sf[W], zf[W];
    for (int i = 0; i < W; ++i) {
      sf[i] = internal::HalfToFloat(scale[c0 + i]);
      zf[i] = internal::HalfToFloat(zero[c0 + i]);
    }
    for (int t0 = 0; t0 < tokens; t0 += W) {
      typename Isa::F v[W];
      for (int i = 0; i < W; ++i)
        v[i] = Isa::Add(Isa::Set1(zf[i]),
                        Isa::Mul(Isa::Set1(sf[i]), Decode<B>(codes + (c0 + i) * rb + t0 * B / 8)));
      Isa::TransposeSquare(v);
      for (int j = 0; j < W; ++j) Isa::Store(out + (t0 + j) * ld + c0, v[j]);
    }
  }
}

// Channel rows: each channel's codes decoded W tokens per vector straight into its row.
template <int B>
void DequantizeChannelRowsB(const uint8_t* codes, int n_ch, int tokens, const uint16_t* scale,
                            const uint16_t* zero, float* out, int64_t ld) {
  const int64_t rb = internal::RowBytes(tokens, B);
  for (int c = 0; c < n_ch; ++c) {
    const typename Isa::F s = Isa::Set1(internal::HalfToFloat(scale[c]));
    const typename Isa::F z = Isa::Set1(internal::HalfToFloat(zero[c]));
    for (int t0 = 0; t0 < tokens; t0 += W)
      Isa::Store(out + c * ld + t0,
                 Isa::Add(z, Isa::Mul(s, Decode<B>(codes + c * rb + t0 * B / 8))));
  }
}

void dequantize_channels_simd(const uint8_t* codes, int bits, int n_ch, int tokens,
                              const uint16_t* scale, const uint16_t* zero, float* out, int64_t ld,
                              bool by_channel) {
  if (tokens % W != 0)
    return Ref().dequantize_channels(codes, bits, n_ch, tokens, scale, zero, out, ld, by_channel);
  if (by_channel) {
    switch (bits) {
      case 1:
        return DequantizeChannelRowsB<1>(codes, n_ch, tokens, scale, zero, out, ld);
      case 2:
        return DequantizeChannelRowsB<2>(codes, n_ch, tokens, scale, zero, out, ld);
      case 3:
        return DequantizeChannelRowsB<3>(codes, n_ch, tokens, scale, zero, out, ld);
      case 4:
        return DequantizeChannelRowsB<4>(codes, n_ch, tokens, scale, zero, out, ld);
      case 8:
        return DequantizeChannelRowsB<8>(codes, n_ch, tokens, scale, zero, out, ld);
      default:
        return Ref().dequantize_channels(codes, bits, n_ch, tokens, scale, zero, out, ld, true);
    }
  }
  switch (bits) {
    case 1:
      DequantizeChannelsB<1>(codes, n_ch, tokens, scale, zero, out, ld);
      break;
    case 2:
      DequantizeChannelsB<2>(codes, n_ch, tokens, scale, zero, out, ld);
      break;
    case 3:
      DequantizeChannelsB<3>(codes, n_ch, tokens, scale, zero, out, ld);
      break;
    case 4:
      DequantizeChannelsB<4>(codes, n_ch, tokens, scale, zero, out, ld);
      break;
    case 8:
      DequantizeChannelsB<8>(codes, n_ch, tokens, scale, zero, out, ld);
      break;
    default:
      return Ref().dequantize_channels(codes, bits, n_ch, tokens, scale, zero, out, ld, false);
  }
  const int c0 = n_ch / W * W;  // channels past the last whole tile: the reference's loop
  if (c0 < n_ch)
    Ref().dequantize_channels(codes + c0 * internal::RowBytes(tokens, bits), bits, n_ch - c0,
                              tokens, scale + c0, zero + c0, out + c0, ld, false);
}

// add_low_rank's token loop for a rank R known at compile time (no loop or branch per rank
// step; the same operations in the same order): coef [R][tokens], bt the basis [R][d]. One
// vector of channels at a time, its R basis vectors held in registers across the tokens.
template <int R>
void AddLowRankRows(const float* bt, const float* coef, int tokens, int d, float* out, int64_t ld) {
  for (int c0 = 0; c0 < d; c0 += W) {
    typename Isa::F b[R];
    for (int j = 0; j < R; ++j) b[j] = Isa::Load(bt + static_cast<size_t>(j) * d + c0);
    for (int t = 0; t < tokens; ++t) {
      typename Isa::F acc = Isa::Zero();
      for (int j = 0; j < R; ++j)
        acc = Isa::Add(acc, Isa::Mul(b[j], Isa::Set1(coef[static_cast<size_t>(j) * tokens + t])));
      float* row = out + t * ld + c0;
      Isa::Store(row, Isa::Add(Isa::Load(row), acc));
    }
  }
}

// add_low_rank into channel rows: coef [r][tokens] (every token's z_j), basis [d][r]; channel c's
// row gets, W tokens per vector, the same products and sums in the same order as a token row's
// element (b z = z b: IEEE multiplication commutes).
void AddLowRankChannels(const float* basis, int r, const float* coef, int tokens, int d, float* out,
                        int64_t ld) {
  for (int c = 0; c < d; ++c) {
    float* row = out + c * ld;
    for (int t0 = 0; t0 < tokens; t0 += W) {
      typename Isa::F acc = Isa::Zero();
      for (int j = 0; j < r; ++j)
        acc = Isa::Add(acc, Isa::Mul(Isa::Set1(basis[static_cast<int64_t>(c) * r + j]),
                                     Isa::Load(coef + static_cast<size_t>(j) * tokens + t0)));
      Isa::Store(row + t0, Isa::Add(Isa::Load(row + t0), acc));
    }
  }
}

void add_low_rank_simd(const uint8_t* codes, int bits, int r, int tokens, const uint16_t* scale,
                       const uint16_t* zero, float sign, const float* basis, int d, float* out,
                       int64_t ld, bool by_channel) {
  constexpr int kMaxRank = 16;
  if (by_channel ? tokens % W != 0 || r > kMaxRank : d % W != 0 || r > kMaxRank || d > 512)
    return Ref().add_low_rank(codes, bits, r, tokens, scale, zero, sign, basis, d, out, ld,
                              by_channel);
  const int64_t rb = internal::RowBytes(tokens, bits);
  float sf[kMaxRank], zf[kMaxRank], z[kMaxRank];
  for (int j = 0; j < r; ++j) {
    sf[j] = internal::HalfToFloat(scale[j]);
    zf[j] = internal::HalfToFloat(zero[j]);
  }
  // Every token's coefficients first, W tokens per vector (the same operations as the scalar
  // line below: sign * (zero + scale * code)), so that the loop over tokens reads them.
  thread_local std::vector<float> coef;  // [r][tokens]
  const bool vector_coef = tokens % W == 0 && (bits == 4 || bits == 8);
  if (vector_coef) {
    coef.resize(static_cast<size_t>(r) * tokens);
    for (int j = 0; j < r; ++j) {
      const typename Isa::F s = Isa::Set1(sf[j]), zz = Isa::Set1(zf[j]), sg = Isa::Set1(sign);
      for (int t = 0; t < tokens; t += W) {
        const typename Isa::F c =
            bits == 4 ? Decode<4>(codes + j * rb + t / 2) : Decode<8>(codes + j * rb + t);
        Isa::Store(coef.data() + static_cast<size_t>(j) * tokens + t,
                   Isa::Mul(sg, Isa::Add(zz, Isa::Mul(s, c))));
      }
    }
  }
  if (by_channel) {
    if (!vector_coef) {  // the scalar line below, for every token
      coef.resize(static_cast<size_t>(r) * tokens);
      for (int j = 0; j < r; ++j)
        for (int t = 0; t < tokens; ++t)
          coef[static_cast<size_t>(j) * tokens + t] =
              sign *
              (zf[j] + sf[j] * static_cast<float>(internal::GetCode(codes + j * rb, bits, t)));
    }
    return AddLowRankChannels(basis, r, coef.data(), tokens, d, out, ld);
  }
  // Token rows: the basis transposed, [r][d], so that a vector of channels is one load.
  thread_local std::vector<float> bt;
  bt.resize(static_cast<size_t>(r) * d);
  for (int c = 0; c < d; ++c)
    for (int j = 0; j < r; ++j)
      bt[static_cast<size_t>(j) * d + c] = basis[static_cast<int64_t>(c) * r + j];
  if (vector_coef && r == 4) return AddLowRankRows<4>(bt.data(), coef.data(), tokens, d, out, ld);
  if (vector_coef && r == 8) return AddLowRankRows<8>(bt.data(), coef.data(), tokens, d, out, ld);
  for (int t = 0; t < tokens; ++t) {
    for (int j = 0; j < r; ++j)
      z[j] = vector_coef
                 ? coef[static_cast<size_t>(j) * tokens + t]
                 : sign * (zf[j] +
                           sf[j] * static_cast<float>(internal::GetCode(codes + j * rb, bits, t)));
    float* row = out + t * ld;
    for (int c0 = 0; c0 < d; c0 += W) {
      typename Isa::F acc = Isa::Zero();
      for (int j = 0; j < r; ++j)
        acc = Isa::Add(
            acc, Isa::Mul(Isa::Load(bt.data() + static_cast<size_t>(j) * d + c0), Isa::Set1(z[j])));
      Isa::Store(row + c0, Isa::Add(Isa::Load(row + c0), acc));
    }
  }
}

// One record's codes (bits B), group by group: each group's scale and zero read once from the
// record (records may sit at odd addresses: read byte-wise), then its vectors.
template <int B>
void DequantizeRowB(const uint8_t* rec, int n, int group, int ng, float* out) {
  const uint8_t* codes = rec + 4 * ng;
  for (int g = 0, c0 = 0; g < ng; ++g) {
    const typename Isa::F s =
        Isa::Set1(internal::HalfToFloat(static_cast<uint16_t>(format::LoadU16(rec + 2 * g))));
    const typename Isa::F z = Isa::Set1(
        internal::HalfToFloat(static_cast<uint16_t>(format::LoadU16(rec + 2 * (ng + g)))));
    for (const int end = std::min(n, c0 + group); c0 < end; c0 += W)
      Isa::Store(out + c0, Isa::Add(z, Isa::Mul(s, Decode<B>(codes + c0 * B / 8))));
  }
}

void dequantize_rows_simd(const uint8_t* rows, const uint8_t* row_bits, int n_rows, int n,
                          int group, float* out, int64_t ld) {
  const int ng = (n + group - 1) / group;
  if (n % W != 0 || group % W != 0)
    return Ref().dequantize_rows(rows, row_bits, n_rows, n, group, out, ld);
  const uint8_t* rec = rows;
  for (int t = 0; t < n_rows; ++t) {
    float* o = out + t * ld;
    switch (row_bits[t]) {
      case 1:
        DequantizeRowB<1>(rec, n, group, ng, o);
        break;
      case 2:
        DequantizeRowB<2>(rec, n, group, ng, o);
        break;
      case 3:
        DequantizeRowB<3>(rec, n, group, ng, o);
        break;
      case 4:
        DequantizeRowB<4>(rec, n, group, ng, o);
        break;
      case 8:
        DequantizeRowB<8>(rec, n, group, ng, o);
        break;
      default:
        Ref().dequantize_rows(rec, row_bits + t, 1, n, group, o, ld);
        break;
    }
    rec += 4 * ng + internal::RowBytes(n, row_bits[t]);
  }
}

const KernelTable kTable{Isa::kName, quantize_channels_simd, quantize_row_simd, quantize_rows_simd,
                         score_codes_simd, readout_rows_simd, dense_scores_f16_simd,
                         dense_readout_f16_simd, project_residual_simd, xxh3_simd, exp_sum_simd,
                         softmax_simd, dense_scores_f32_simd, max_value_simd,
                         dequantize_channels_simd, add_low_rank_simd, dequantize_rows_simd,
                         // The reference's bits on every table (kernels.h): the scalar loops.
                         internal::ProjectQueries, internal::DenseReadoutF32};
