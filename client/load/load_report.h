// kvq-load's measurements: per-method latency samples, bytes and errors, and the final
// report (a text table and the JSON format of the client issue).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace kvq::load {

// What one worker saw for one method. Latencies in seconds, one sample per request.
struct MethodStats {
  int64_t requests = 0;
  int64_t errors = 0;  // requests with a failed call or at least one failed item
  int64_t bytes = 0;   // request + response message bytes of successful requests
  std::vector<double> latency_s;
  std::map<std::string, int64_t> errors_by_code;  // "UNAVAILABLE" -> count
  void Merge(const MethodStats& o);
};

struct MethodSummary {
  int64_t requests = 0, errors = 0;
  double rps = 0, gbps = 0;
  double p50_ms = 0, p90_ms = 0, p99_ms = 0, max_ms = 0;
};

// Nearest-rank percentile (p in 0..100) of unsorted samples; 0 for none.
double Percentile(std::vector<double> samples, double p);
MethodSummary Summarize(const MethodStats& s, double wall_seconds);

// {"methods": {name: {requests, errors, rps, gbps, p50_ms, p90_ms, p99_ms, max_ms}},
//  "errors_by_code": {code: n}, "config": config}
nlohmann::json ReportJson(const std::map<std::string, MethodStats>& methods, double wall_seconds,
                          const nlohmann::json& config);
std::string ReportText(const std::map<std::string, MethodStats>& methods, double wall_seconds);

}  // namespace kvq::load
