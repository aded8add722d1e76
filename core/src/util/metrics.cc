#include "kvq/core/metrics.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace kvq::core {

void Softmax(const float* s, int64_t n, float* p) {
  const float mx = *std::max_element(s, s + n);
  double sum = 0;
  for (int64_t j = 0; j < n; ++j) sum += (p[j] = std::exp(s[j] - mx));
  for (int64_t j = 0; j < n; ++j) p[j] = static_cast<float>(p[j] / sum);
}

double MeanSquaredError(const float* a, const float* b, int64_t n) {
  double e = 0;
  for (int64_t j = 0; j < n; ++j) e += (double(a[j]) - b[j]) * (double(a[j]) - b[j]);
  return n ? e / n : 0.0;
}

double FisherScoreError(const float* s_exact, const float* s_approx, int64_t n) {
  std::vector<float> p(n);
  Softmax(s_exact, n, p.data());
  double m1 = 0, m2 = 0;
  for (int64_t j = 0; j < n; ++j) {
    const double ds = double(s_approx[j]) - s_exact[j];
    m1 += p[j] * ds;
    m2 += p[j] * ds * ds;
  }
  return 0.5 * std::max(0.0, m2 - m1 * m1);
}

double AttentionKL(const float* s_exact, const float* s_approx, int64_t n) {
  // log-sum-exp in double for both, then sum p (log p - log p').
  auto lse = [n](const float* s) {
    double mx = *std::max_element(s, s + n), sum = 0;
    for (int64_t j = 0; j < n; ++j) sum += std::exp(s[j] - mx);
    return mx + std::log(sum);
  };
  const double a = lse(s_exact), b = lse(s_approx);
  double kl = 0;
  for (int64_t j = 0; j < n; ++j) {
    const double lp = s_exact[j] - a, lq = s_approx[j] - b;
    kl += std::exp(lp) * (lp - lq);
  }
  return std::max(0.0, kl);
}

double A2ValueDistortion(const float* w, const float* v, const float* v_hat, int64_t n, int d) {
  double e = 0;
  for (int64_t j = 0; j < n; ++j) {
    double r = 0;
    for (int c = 0; c < d; ++c) {
      const double x = double(v[j * d + c]) - v_hat[j * d + c];
      r += x * x;
    }
    e += w[j] * r;
  }
  return e;
}

double RelativeOutputError(const float* o, const float* o_hat, int d) {
  double num = 0, den = 0;
  for (int c = 0; c < d; ++c) {
    num += (double(o[c]) - o_hat[c]) * (double(o[c]) - o_hat[c]);
    den += double(o[c]) * o[c];
  }
  return den > 0 ? num / den : num;
}

namespace {
std::vector<double> Ranks(const std::vector<double>& x) {
  std::vector<size_t> idx(x.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return x[a] < x[b]; });
  std::vector<double> r(x.size());
  for (size_t i = 0; i < idx.size();) {
    size_t j = i;
    while (j + 1 < idx.size() && x[idx[j + 1]] == x[idx[i]]) ++j;
    const double avg = 0.5 * (i + j) + 1;  // ties share their mean rank
    for (size_t k = i; k <= j; ++k) r[idx[k]] = avg;
    i = j + 1;
  }
  return r;
}
}  // namespace

double SpearmanRho(const std::vector<double>& x, const std::vector<double>& y) {
  if (x.size() != y.size() || x.size() < 2) return 0.0;
  const auto rx = Ranks(x), ry = Ranks(y);
  const double n = static_cast<double>(x.size());
  const double mx = (n + 1) / 2;
  double sxy = 0, sxx = 0, syy = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    sxy += (rx[i] - mx) * (ry[i] - mx);
    sxx += (rx[i] - mx) * (rx[i] - mx);
    syy += (ry[i] - mx) * (ry[i] - mx);
  }
  return sxx > 0 && syy > 0 ? sxy / std::sqrt(sxx * syy) : 0.0;
}

}  // namespace kvq::core
