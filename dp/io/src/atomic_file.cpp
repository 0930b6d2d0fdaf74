// atomic_file.cpp — temporary file, fsync, rename, directory fsync (dp/atomic_file.h).
#include "dp/io/atomic_file.h"

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <fmt/format.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dp/runtime/error.h"

namespace dp {
namespace {

// The directory `path` is written into.
std::filesystem::path directory_of(const std::string& path) {
  const std::filesystem::path target(path);
  return target.has_parent_path() ? target.parent_path() : std::filesystem::path(".");
}

// ".dp-<8 hex digits>-": the prefix of write_atomically's temporary files for the target `name` (FNV-1a of
// the name, stable across builds), short enough that a name of any legal length still fits.
std::string temp_prefix(const std::string& name) {
  std::uint32_t hash = 2166136261u;
  for (const unsigned char c : name) hash = (hash ^ c) * 16777619u;
  return fmt::format(".dp-{:08x}-", hash);
}

// What check_writable() can tell without creating a file.
void check_target(const std::string& path) {
  if (path.empty()) throw Error("empty path: a file name is needed");
  std::error_code ec;
  const auto status = std::filesystem::symlink_status(path, ec);
  if (std::filesystem::exists(status) && !std::filesystem::is_regular_file(status))
    throw Error(
        fmt::format("{}: exists and is not a regular file (a directory, device, FIFO or symbolic link): "
                    "refusing to replace it",
                    path));
  const std::filesystem::path dir = directory_of(path);
  if (!std::filesystem::is_directory(dir, ec))
    throw Error(fmt::format("{}: directory {} does not exist", path, dir.string()));
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    throw Error(fmt::format("{}: directory {} is not writable ({})", path, dir.string(), std::strerror(errno)));
  if (std::filesystem::path(path).filename().string().size() > 255)
    throw Error(fmt::format("{}: file name longer than 255 characters", path));
}

// mkstemp beside `path` under its short temporary name, which carries this process's id: the open
// descriptor, the name in `temp`. Each writer's temporary file is its own, so writers of one target
// at once never touch each other's, and the last to rename wins.
int create_temp(const std::string& path, std::string& temp) {
  const std::filesystem::path dir = directory_of(path);
  temp = (dir / fmt::format("{}{}-XXXXXX", temp_prefix(std::filesystem::path(path).filename().string()), ::getpid()))
             .string();
  const int fd = ::mkstemp(temp.data());
  if (fd < 0)
    throw Error(fmt::format("{}: cannot create a temporary file in {} ({})", path, dir.string(), std::strerror(errno)));
  return fd;
}

// Removes the temporary files of `prefix` in `dir` that a killed earlier write left behind: those
// whose writer (the process id in the name, "<prefix><pid>-XXXXXX") no longer runs on this host.
// A live writer's file, another save of the same target at the same time, is kept.
void remove_stale_temps(const std::filesystem::path& dir, const std::string& prefix) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) != 0 || name.size() < prefix.size() + 8) continue;
    const std::string pid = name.substr(prefix.size(), name.size() - prefix.size() - 7);
    if (name[name.size() - 7] != '-' || pid.empty() || pid.size() > 9 ||
        pid.find_first_not_of("0123456789") != std::string::npos)
      continue;
    if (::kill(static_cast<pid_t>(std::stol(pid)), 0) != 0 && errno == ESRCH) std::filesystem::remove(entry.path(), ec);
  }
}

// A failed step of writing `path`'s temporary file (already removed): a destination that cannot
// hold the file (the file-size limit, a full disk or quota) is the caller's to fix, InvalidArgument;
// anything else is Error. The target is as it was either way.
[[noreturn]] void write_failed(const std::string& path, const char* what, int error) {
  std::string cause = std::strerror(error);
  rlimit limit{};
  if (error == EFBIG && ::getrlimit(RLIMIT_FSIZE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY)
    cause += fmt::format(": the file-size limit (ulimit -f) is {} bytes", limit.rlim_cur);
  const std::string message = fmt::format("{}: {} failed ({}); the file is as it was", path, what, cause);
  if (error == EFBIG || error == ENOSPC || error == EDQUOT) throw InvalidArgument(message);
  throw Error(message);
}

}  // namespace

void check_writable(const std::string& path) {
  check_target(path);
  // access() does not settle it: root passes it for /proc and /sys, where no file can be created.
  // So the temporary file the save will create is created, and removed, now.
  std::string temp;
  ::close(create_temp(path, temp));
  ::unlink(temp.c_str());
}

void write_atomically(const std::string& path, const std::vector<std::span<const std::byte>>& pieces) {
  check_target(path);
  // A fresh temporary file beside the target (mkstemp: never an existing file or a symlink),
  // flushed to disk, then renamed over the target, and the directory flushed: after a crash the
  // target is the old file or the new one, never a torn or empty one.
  const std::filesystem::path dir = directory_of(path);
  remove_stale_temps(dir, temp_prefix(std::filesystem::path(path).filename().string()));
  std::string temp;
  const int fd = create_temp(path, temp);
  auto fail = [&](const char* what) {
    const int error = errno;
    ::close(fd);
    ::unlink(temp.c_str());
    write_failed(path, what, error);
  };
  auto write_all = [&](const void* data, std::size_t bytes) {
    const char* p = static_cast<const char*>(data);
    while (bytes > 0) {
      const ssize_t n = ::write(fd, p, bytes);
      if (n < 0 && errno == EINTR) continue;
      if (n == 0) errno = EIO;  // a regular file takes at least one byte or says why not
      if (n <= 0) fail("write");
      p += n;
      bytes -= static_cast<std::size_t>(n);
    }
  };
  for (const auto& piece : pieces) write_all(piece.data(), piece.size());
  if (::fchmod(fd, 0644) != 0) fail("chmod");
  if (::fsync(fd) != 0) fail("fsync");
  if (::close(fd) != 0) {
    const int error = errno;
    ::unlink(temp.c_str());
    write_failed(path, "close", error);
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    const int error = errno;
    ::unlink(temp.c_str());
    throw Error(fmt::format("{}: cannot replace ({})", path, std::strerror(error)));
  }
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);  // best effort: some file systems refuse fsync on directories
    ::close(dir_fd);
  }
}

std::string atomic_temp_prefix(const std::string& path) {
  return temp_prefix(std::filesystem::path(path).filename().string());
}

void write_atomically(const std::string& path, const std::string& text) {
  write_atomically(path, {std::as_bytes(std::span(text.data(), text.size()))});
}

}  // namespace dp
