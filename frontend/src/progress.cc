#include "kvq/frontend/progress.h"

#include <unistd.h>

#include <cstdio>

namespace kvq::frontend {

ProgressBar::ProgressBar(std::string label, int64_t total)
    : label_(std::move(label)),
      total_(total > 0 ? total : 1),
      tty_(isatty(2) != 0),
      t0_(std::chrono::steady_clock::now()) {}

void ProgressBar::Update(int64_t done, const std::string& note) {
  const double frac = static_cast<double>(done) / total_;
  const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  const double eta = done > 0 ? el * (total_ - done) / done : 0;
  if (tty_) {
    const int w = 30, fill = static_cast<int>(frac * w);
    std::fprintf(stderr, "\r%s [%.*s%*s] %3d%% %.0fs eta %.0fs %s\x1b[K", label_.c_str(), fill,
                 "##############################", w - fill, "", static_cast<int>(frac * 100), el,
                 eta, note.c_str());
  } else {
    const int dec = static_cast<int>(frac * 10);
    if (dec == last_decile_) return;
    last_decile_ = dec;
    std::fprintf(stderr, "%s %3d%% %.0fs eta %.0fs %s\n", label_.c_str(), dec * 10, el, eta,
                 note.c_str());
  }
  std::fflush(stderr);
}

void ProgressBar::Finish() {
  Update(total_);
  if (tty_) std::fputc('\n', stderr);
}

}  // namespace kvq::frontend
