// Distortion metrics (docs/CODEC.md, "Distortion metrics"), for one query against n cached tokens.
#pragma once

#include <cstdint>
#include <vector>

namespace kvq::core {

// p = softmax(s), numerically stable; writes n probabilities.
void Softmax(const float* s, int64_t n, float* p);

// Mean squared error of two arrays.
double MeanSquaredError(const float* a, const float* b, int64_t n);

// Fisher-weighted score-error variance: 1/2 (sum p ds^2 - (sum p ds)^2) with p = softmax(s).
// Invariant to adding a constant to every ds (softmax-null).
double FisherScoreError(const float* s_exact, const float* s_approx, int64_t n);

// KL(softmax(s_exact) || softmax(s_approx)), exact.
double AttentionKL(const float* s_exact, const float* s_approx, int64_t n);

// A^2-weighted value distortion: sum_j w_j ||v_j - v_hat_j||^2, v [n][d].
double A2ValueDistortion(const float* w, const float* v, const float* v_hat, int64_t n, int d);

// ||o - o_hat||^2 / ||o||^2 (relative output error), o [d].
double RelativeOutputError(const float* o, const float* o_hat, int d);

// Spearman rank correlation of two samples.
double SpearmanRho(const std::vector<double>& x, const std::vector<double>& y);

}  // namespace kvq::core
