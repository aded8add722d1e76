#include "kvq/core/env.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"

namespace kvq::core {
namespace fs = std::filesystem;

absl::Status Env::WriteFile(const std::string& path, absl::string_view bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return absl::InternalError(absl::StrCat("cannot write ", path));
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  f.flush();
  if (!f) return absl::InternalError(absl::StrCat("short write to ", path));
  return absl::OkStatus();
}

absl::StatusOr<std::string> Env::ReadFile(const std::string& path, size_t limit) {
  std::error_code ec;
  const uintmax_t size = fs::file_size(path, ec);
  if (ec) return absl::NotFoundError(absl::StrCat("cannot read ", path, ": ", ec.message()));
  if (size > limit) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " holds ", size, " bytes, over the limit of ", limit));
  }
  std::ifstream f(path, std::ios::binary);
  std::string s(size, '\0');
  f.read(s.data(), static_cast<std::streamsize>(size));
  if (!f) return absl::DataLossError(absl::StrCat(path, ": short read"));
  return s;
}

absl::Status Env::Sync(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::InternalError(
        absl::StrCat("cannot open ", path, " to fsync it: ", std::strerror(errno)));
  }
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0)
    return absl::InternalError(absl::StrCat("cannot fsync ", path, ": ", std::strerror(err)));
  return absl::OkStatus();
}

absl::Status Env::Rename(const std::string& from, const std::string& to) {
  std::error_code ec;
  fs::rename(from, to, ec);
  if (ec)
    return absl::InternalError(
        absl::StrCat("cannot rename ", from, " to ", to, ": ", ec.message()));
  return absl::OkStatus();
}

absl::Status Env::CreateDirs(const std::string& path) {
  std::error_code ec;
  fs::create_directories(path, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", path, ": ", ec.message()));
  return absl::OkStatus();
}

absl::Status Env::RemoveAll(const std::string& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot remove ", path, ": ", ec.message()));
  return absl::OkStatus();
}

absl::Status Env::WriteFileAtomic(const std::string& path, absl::string_view bytes) {
  const std::string tmp = path + ".tmp";
  absl::Status st = WriteFile(tmp, bytes);
  if (st.ok()) st = Rename(tmp, path);
  if (!st.ok()) (void)RemoveAll(tmp);
  return st;
}

Env* Env::Default() {
  static Env* env = new Env();
  return env;
}

}  // namespace kvq::core
