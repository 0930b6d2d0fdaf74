// text.cpp — a text file's bytes as windows of tokens (dp/io/text.h).
#include "dp/io/text.h"

#include <filesystem>
#include <fmt/format.h>
#include <fstream>

#include "dp/runtime/error.h"

namespace dp {

TextCorpus load_text(const std::string& path, int context) {
  if (context < 1) throw InvalidArgument(fmt::format("{}: a window of {} bytes", path, context));
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(status)) throw Error(fmt::format("{}: no such file", path));
  // A FIFO or a device would block or never end: only a file whose size is known is read.
  if (!std::filesystem::is_regular_file(status)) throw Error(fmt::format("{}: not a regular file", path));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("{}: cannot be opened for reading", path));
  // Read into its final size at once: memory is the file's bytes, never a grown copy of twice that.
  TextCorpus corpus;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) throw Error(fmt::format("{}: {}", path, ec.message()));
  corpus.bytes.resize(size);
  in.read(reinterpret_cast<char*>(corpus.bytes.data()), static_cast<std::streamsize>(size));
  if (in.bad() || static_cast<std::uintmax_t>(in.gcount()) != size || in.peek() != std::ifstream::traits_type::eof())
    throw Error(fmt::format("{}: read error (the file changed or could not be read whole)", path));
  const std::size_t n = corpus.bytes.size(), window = static_cast<std::size_t>(context) + 1;
  if (n < 10 * window)
    throw Error(
        fmt::format("{}: {} bytes is too short for --context {}: the held-out last 10 % must hold a window "
                    "of {} bytes (at least {} bytes in all)",
                    path, n, context, window, 10 * window));
  corpus.split = n - n / 10;
  return corpus;
}

TextWindows::TextWindows(std::shared_ptr<const TextCorpus> corpus, Split split, int context)
    : corpus_(std::move(corpus)), context_(context) {
  const std::size_t n = corpus_->bytes.size(), window = static_cast<std::size_t>(context) + 1;
  const std::size_t end = split == Split::train ? corpus_->split : n;
  begin_ = split == Split::train ? 0 : corpus_->split;
  if (context < 1 || corpus_->split > n || end - begin_ < window)
    throw InvalidArgument(
        fmt::format("text of {} bytes (split at {}) holds no window of {} bytes", n, corpus_->split, window));
  stride_ = split == Split::train ? 1 : static_cast<std::size_t>(context);
  count_ = split == Split::train ? end - begin_ - static_cast<std::size_t>(context)
                                 : (end - begin_ - 1) / static_cast<std::size_t>(context);
}

void TextWindows::fill(std::size_t index, const SampleKey&, InputsOut out) const {
  const std::size_t at = start(index);
  std::int32_t* ids = out.ids();
  for (int t = 0; t < context_; ++t) ids[t] = byte(at + static_cast<std::size_t>(t));
}

void TextWindows::fill_targets(std::size_t index, std::int64_t* out) const {
  const std::size_t at = start(index) + 1;
  for (int t = 0; t < context_; ++t) out[t] = byte(at + static_cast<std::size_t>(t));
}

}  // namespace dp
