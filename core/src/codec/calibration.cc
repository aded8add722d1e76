#include "kvq/core/calibration.h"

#include <Eigen/Dense>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace kvq::core {

QueryStats::QueryStats(int layers, int q_heads, int kv_heads, int head_dim)
    : layers_(layers), q_heads_(q_heads), kv_heads_(kv_heads), d_(head_dim) {
  const size_t heads = static_cast<size_t>(layers) * kv_heads;
  m2_.assign(heads * d_ * d_, 0.0);
  m1_.assign(heads * d_, 0.0);
  res2_.assign(heads * d_, 0.0);
  res_m2_.assign(heads * d_ * d_, 0.0);
  n_.assign(heads, 0);
  nres_.assign(heads, 0);
}

void QueryStats::Add(int layer, int q_head, const float* q, int64_t n) {
  const int kv = q_head / (q_heads_ / kv_heads_);
  const size_t hi = static_cast<size_t>(layer) * kv_heads_ + kv;
  double* m2 = m2_.data() + hi * d_ * d_;
  double* m1 = m1_.data() + hi * d_;
  for (int64_t t = 0; t < n; ++t) {
    const float* x = q + t * d_;
    for (int a = 0; a < d_; ++a) {
      m1[a] += x[a];
      const double xa = x[a];
      for (int b = a; b < d_; ++b) m2[a * d_ + b] += xa * x[b];  // upper triangle
    }
  }
  n_[hi] += n;
}

void QueryStats::AddResidual(int layer, int kv_head, const float* e, int64_t n) {
  const size_t hi = static_cast<size_t>(layer) * kv_heads_ + kv_head;
  double* r = res2_.data() + hi * d_;
  double* m2 = res_m2_.data() + hi * d_ * d_;
  for (int64_t t = 0; t < n; ++t) {
    const float* x = e + t * d_;
    for (int a = 0; a < d_; ++a) {
      r[a] += double(x[a]) * x[a];
      const double xa = x[a];
      for (int b = a; b < d_; ++b) m2[a * d_ + b] += xa * x[b];
    }
  }
  nres_[hi] += n;
}

int64_t QueryStats::count(int layer, int kv_head) const {
  return n_[static_cast<size_t>(layer) * kv_heads_ + kv_head];
}

namespace {

// Each column's sign fixed so that its entry of largest magnitude is positive (the first of
// equal ones): an eigensolver returns either sign, and the side code's rounding depends on it,
// so two fits of one subspace (kvq-calibrate, kvq-calibrate-hf in any channel order) give one
// basis. `along` (the oblique pair's encode columns, or null) flips with its decode column.
void CanonicalSigns(Eigen::MatrixXd* u, Eigen::MatrixXd* along) {
  for (Eigen::Index j = 0; j < u->cols(); ++j) {
    Eigen::Index at = 0;
    u->col(j).cwiseAbs().maxCoeff(&at);
    if ((*u)(at, j) >= 0) continue;
    u->col(j) *= -1;
    if (along) along->col(j) *= -1;
  }
}

}  // namespace

absl::StatusOr<ModelBasis> QueryStats::Basis(int rank, const CalibrationOptions& opts,
                                             BasisManifest manifest) const {
  if (rank < 1 || rank > d_)
    return absl::InvalidArgumentError(absl::StrCat("rank = ", rank, ": must be in [1, ", d_, "]"));
  ModelBasis b;
  manifest.layers = layers_;
  manifest.kv_heads = kv_heads_;
  manifest.q_heads = q_heads_;
  manifest.head_dim = d_;
  manifest.rank = rank;
  manifest.kind = opts.oblique             ? "oblique_rrr"
                  : opts.residual_weighted ? "query_pca_residual_weighted"
                  : opts.centred           ? "query_pca_centred"
                                           : "query_pca_uncentred";
  int64_t total = 0;
  b.u.assign(static_cast<size_t>(layers_) * kv_heads_ * d_ * rank, 0.0f);
  if (opts.oblique) b.encode.assign(b.u.size(), 0.0f);
  if (opts.keep_query_moment)
    b.query_moment.assign(static_cast<size_t>(layers_) * kv_heads_ * d_ * d_, 0.0f);
  for (int l = 0; l < layers_; ++l)
    for (int h = 0; h < kv_heads_; ++h) {
      const size_t hi = static_cast<size_t>(l) * kv_heads_ + h;
      const int64_t n = n_[hi];
      if (n == 0)
        return absl::FailedPreconditionError(
            absl::StrCat("no calibration queries for layer ", l, " kv head ", h));
      total += n;
      Eigen::MatrixXd m(d_, d_);
      for (int a = 0; a < d_; ++a)
        for (int c = a; c < d_; ++c) m(a, c) = m(c, a) = m2_[hi * d_ * d_ + a * d_ + c] / n;
      if (opts.keep_query_moment)
        for (int a = 0; a < d_; ++a)
          for (int c = 0; c < d_; ++c)
            b.query_moment[(hi * d_ + a) * d_ + c] = static_cast<float>(m(a, c));
      if (opts.centred) {
        Eigen::VectorXd mu(d_);
        for (int a = 0; a < d_; ++a) mu(a) = m1_[hi * d_ + a] / n;
        m -= mu * mu.transpose();
      }
      if (opts.residual_weighted && nres_[hi] > 0) {
        // Score error of residual e is q.e; with e_c ~ sigma_c independent, E[(q.e)^2] =
        // sum_c sigma_c^2 E[q_c^2]: diagonalize D^1/2 M D^1/2 and map back to an orthonormal
        // basis of the span of D^1/2 v (QR).
        Eigen::VectorXd s(d_);
        for (int a = 0; a < d_; ++a) s(a) = std::sqrt(res2_[hi * d_ + a] / nres_[hi]) + 1e-12;
        m = s.asDiagonal() * m * s.asDiagonal();
      }
      if (opts.oblique) {
        if (nres_[hi] == 0)
          return absl::FailedPreconditionError(
              absl::StrCat("no residual statistics for layer ", l, " kv head ", h));
        Eigen::MatrixXd se(d_, d_);
        for (int a = 0; a < d_; ++a)
          for (int c = a; c < d_; ++c)
            se(a, c) = se(c, a) = res_m2_[hi * d_ * d_ + a * d_ + c] / nres_[hi];
        // A small ridge keeps R^-1 bounded along directions the residual never takes.
        se += Eigen::MatrixXd::Identity(d_, d_) * (1e-4 * se.trace() / d_ + 1e-20);
        Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> ee(se);
        const Eigen::VectorXd sq = ee.eigenvalues().cwiseSqrt();
        const Eigen::MatrixXd R =
            ee.eigenvectors() * sq.asDiagonal() * ee.eigenvectors().transpose();
        const Eigen::MatrixXd Rinv =
            ee.eigenvectors() * sq.cwiseInverse().asDiagonal() * ee.eigenvectors().transpose();
        Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> es(R * m * R);
        Eigen::MatrixXd w(d_, rank);
        for (int j = 0; j < rank; ++j) w.col(j) = es.eigenvectors().col(d_ - 1 - j);
        Eigen::MatrixXd dec = R * w, enc = Rinv * w;
        for (int j = 0; j < rank; ++j) {  // unit decode columns; A^T B = I is kept
          const double s = dec.col(j).norm();
          dec.col(j) /= s;
          enc.col(j) *= s;
        }
        CanonicalSigns(&dec, &enc);
        float* u = b.u.data() + hi * d_ * rank;
        float* a_ = b.encode.data() + hi * d_ * rank;
        for (int a = 0; a < d_; ++a)
          for (int j = 0; j < rank; ++j) {
            u[a * rank + j] = static_cast<float>(dec(a, j));
            a_[a * rank + j] = static_cast<float>(enc(a, j));
          }
        continue;
      }
      Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> es(m);
      Eigen::MatrixXd top(d_, rank);
      for (int j = 0; j < rank; ++j) top.col(j) = es.eigenvectors().col(d_ - 1 - j);
      if (opts.residual_weighted && nres_[hi] > 0) {
        Eigen::VectorXd s(d_);
        for (int a = 0; a < d_; ++a) s(a) = std::sqrt(res2_[hi * d_ + a] / nres_[hi]) + 1e-12;
        Eigen::MatrixXd mapped = s.asDiagonal() * top;
        Eigen::HouseholderQR<Eigen::MatrixXd> qr(mapped);
        top = qr.householderQ() * Eigen::MatrixXd::Identity(d_, rank);
      }
      CanonicalSigns(&top, nullptr);
      float* u = b.u.data() + hi * d_ * rank;
      for (int a = 0; a < d_; ++a)
        for (int j = 0; j < rank; ++j) u[a * rank + j] = static_cast<float>(top(a, j));
    }
  // Each KV head sees q_heads / kv_heads query rows per token.
  manifest.calibration_tokens =
      total / (static_cast<int64_t>(layers_) * kv_heads_) / (q_heads_ / kv_heads_);
  b.manifest = std::move(manifest);
  return b;
}

std::vector<double> QueryStats::CapturedEnergy(const ModelBasis& b) const {
  std::vector<double> out;
  const int r = b.manifest.rank;
  for (int l = 0; l < layers_; ++l)
    for (int h = 0; h < kv_heads_; ++h) {
      const size_t hi = static_cast<size_t>(l) * kv_heads_ + h;
      const double* m2 = m2_.data() + hi * d_ * d_;
      const float* u = b.head(l, h);
      double trace = 0, cap = 0;
      for (int a = 0; a < d_; ++a) trace += m2[a * d_ + a];
      for (int j = 0; j < r; ++j)
        for (int a = 0; a < d_; ++a)
          for (int c = 0; c < d_; ++c) {
            const double m = a <= c ? m2[a * d_ + c] : m2[c * d_ + a];
            cap += u[a * r + j] * m * u[c * r + j];
          }
      out.push_back(trace > 0 ? cap / trace : 0.0);
    }
  return out;
}

}  // namespace kvq::core
