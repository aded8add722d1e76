// A one-line progress bar on stderr (redrawn in place when stderr is a terminal, otherwise
// printed at every 10% so CI logs stay short).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace kvq::frontend {

class ProgressBar {
 public:
  ProgressBar(std::string label, int64_t total);
  void Update(int64_t done, const std::string& note = "");
  void Finish();

 private:
  std::string label_;
  int64_t total_;
  bool tty_;
  int last_decile_ = -1;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace kvq::frontend
