// The file system as core writes and reads it, behind one seam: the registry and the basis
// files go through an Env, so that a test can make any step fail (a write, an fsync, a
// rename) and check what a failing disk leaves behind. Env::Default() is the POSIX one.
// Listing folders stays std::filesystem (a failure there is reported, not injected).
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvq::core {

class Env {
 public:
  virtual ~Env() = default;
  // Creates or truncates `path` and writes `bytes` whole (flushed). INTERNAL naming the path.
  virtual absl::Status WriteFile(const std::string& path, absl::string_view bytes);
  // The whole file: NOT_FOUND when it cannot be read, INVALID_ARGUMENT over `limit` bytes,
  // DATA_LOSS on a short read.
  virtual absl::StatusOr<std::string> ReadFile(const std::string& path, size_t limit);
  // fsync(2) of a file or a folder (a folder's makes its entries, e.g. a rename, durable).
  virtual absl::Status Sync(const std::string& path);
  virtual absl::Status Rename(const std::string& from, const std::string& to);
  virtual absl::Status CreateDirs(const std::string& path);
  // Best effort (cleanup after a failure): the error is returned, never thrown.
  virtual absl::Status RemoveAll(const std::string& path);

  // `path`.tmp written, then renamed over `path`: a reader sees the old file or the new one.
  absl::Status WriteFileAtomic(const std::string& path, absl::string_view bytes);

  // The process's POSIX file system.
  static Env* Default();
};

}  // namespace kvq::core
