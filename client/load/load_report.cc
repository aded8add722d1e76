#include "client/load/load_report.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvq::load {

void MethodStats::Merge(const MethodStats& o) {
  requests += o.requests;
  errors += o.errors;
  bytes += o.bytes;
  latency_s.insert(latency_s.end(), o.latency_s.begin(), o.latency_s.end());
  for (const auto& [code, n] : o.errors_by_code) errors_by_code[code] += n;
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  // Nearest rank: the smallest sample with at least p% of the samples at or below it.
  size_t rank = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(v.size())));
  rank = std::clamp<size_t>(rank, 1, v.size());
  std::nth_element(v.begin(), v.begin() + (rank - 1), v.end());
  return v[rank - 1];
}

MethodSummary Summarize(const MethodStats& s, double wall) {
  MethodSummary m;
  m.requests = s.requests;
  m.errors = s.errors;
  if (wall > 0) {
    m.rps = static_cast<double>(s.requests) / wall;
    m.gbps = static_cast<double>(s.bytes) / wall / 1e9;
  }
  m.p50_ms = Percentile(s.latency_s, 50) * 1e3;
  m.p90_ms = Percentile(s.latency_s, 90) * 1e3;
  m.p99_ms = Percentile(s.latency_s, 99) * 1e3;
  m.max_ms =
      s.latency_s.empty() ? 0 : *std::max_element(s.latency_s.begin(), s.latency_s.end()) * 1e3;
  return m;
}

nlohmann::json ReportJson(const std::map<std::string, MethodStats>& methods, double wall,
                          const nlohmann::json& config) {
  nlohmann::json out;
  out["methods"] = nlohmann::json::object();
  std::map<std::string, int64_t> codes;
  for (const auto& [name, s] : methods) {
    const MethodSummary m = Summarize(s, wall);
    out["methods"][name] = {{"requests", m.requests}, {"errors", m.errors}, {"rps", m.rps},
                            {"gbps", m.gbps},         {"p50_ms", m.p50_ms}, {"p90_ms", m.p90_ms},
                            {"p99_ms", m.p99_ms},     {"max_ms", m.max_ms}};
    for (const auto& [code, n] : s.errors_by_code) codes[code] += n;
  }
  out["errors_by_code"] = nlohmann::json::object();
  for (const auto& [code, n] : codes) out["errors_by_code"][code] = n;
  out["config"] = config;
  return out;
}

std::string ReportText(const std::map<std::string, MethodStats>& methods, double wall) {
  std::string out =
      absl::StrFormat("%-8s %10s %8s %10s %8s %9s %9s %9s %9s\n", "method", "requests", "errors",
                      "req/s", "GB/s", "p50 ms", "p90 ms", "p99 ms", "max ms");
  std::map<std::string, int64_t> codes;
  for (const auto& [name, s] : methods) {
    const MethodSummary m = Summarize(s, wall);
    absl::StrAppendFormat(&out, "%-8s %10d %8d %10.1f %8.4f %9.3f %9.3f %9.3f %9.3f\n", name,
                          m.requests, m.errors, m.rps, m.gbps, m.p50_ms, m.p90_ms, m.p99_ms,
                          m.max_ms);
    for (const auto& [code, n] : s.errors_by_code) codes[code] += n;
  }
  if (codes.empty()) {
    absl::StrAppend(&out, "errors by code: none\n");
  } else {
    absl::StrAppend(&out, "errors by code:");
    for (const auto& [code, n] : codes) absl::StrAppend(&out, " ", code, "=", n);
    absl::StrAppend(&out, "\n");
  }
  return out;
}

}  // namespace kvq::load
