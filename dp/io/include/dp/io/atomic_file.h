// dp/io/atomic_file.h — files written so that a crash, a full disk or a kill never leaves a torn one:
// checkpoints (safetensors), dp_bench's JSON and trace. What a destination must be is checked
// once, here, and can be checked before any work.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <vector>

namespace dp {

// Throws dp::Error unless write_atomically() can write `path`: not empty, absent or a regular file
// (never a directory, device, FIFO or symbolic link, which the rename would replace with a regular
// file), a name of at most 255 bytes, in a directory that exists and is writable — for real: the
// temporary file write_atomically() would create there is created and removed (root passes
// access() for /proc and /sys, where no file can be created).
void check_writable(const std::string& path);

// Writes the pieces, in order, to a temporary file in `path`'s directory, flushes it to disk and
// renames it over `path`: `path` is the old file or the new one, never a torn or empty one. The
// temporary name is short whatever the target's length (".dp-<hash of the name>-<pid>-XXXXXX") and
// its writer's own: writers of one target at once each rename their own file (the last one wins).
// Those a killed earlier write of the same target left behind (their process gone) are removed
// first. Throws dp::Error naming `path` and the failing step, InvalidArgument where the destination
// cannot hold the file (past the file-size limit, a full disk or quota: a program that would rather
// get EFBIG than be killed by SIGXFSZ ignores that signal); no temporary file is left then.
void write_atomically(const std::string& path, const std::vector<std::span<const std::byte>>& pieces);

// The name prefix of write_atomically's temporary files for `path` (in its directory).
std::string atomic_temp_prefix(const std::string& path);

// The same for one string (JSON, text).
void write_atomically(const std::string& path, const std::string& text);

}  // namespace dp
