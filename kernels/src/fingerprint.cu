// fingerprint.cu — launchers for dp/kernels/fingerprint.h: one row reduction of the words' terms.
#include "checks.h"
#include "dp/kernels/detail/launch.h"
#include "dp/kernels/fingerprint.h"
#include "dp/runtime/progress.h"

namespace dp::kernels {

void fingerprint(const Stream& stream, index_t n, const std::uint32_t* words, std::uint64_t first_index,
                 std::uint64_t* out, bool accumulate) {
  const char* op = "fingerprint";
  if (n < 0 || static_cast<std::uint64_t>(n) + first_index > 0xffffffffULL)
    checks::fail({op, ": need 0 <= n and first_index + n < 2^32, got n=", static_cast<long long>(n),
                  " first_index=", static_cast<long long>(first_index)});
  checks::present(op, {{"out", out}});
  if (n > 0) checks::present(op, {{"words", words}});
  if (n == 0) {  // the fingerprint of nothing is 0
    if (!accumulate) launch(stream, op, 1, ClearFingerprint{out}, {operand(out, 1)});
    return;
  }
  launch_row_reduce<Fingerprint>(stream, op, 1, n, FingerprintWords{words, first_index},
                                 StoreFingerprint{out, accumulate}, {operand(words, n), operand(out, 1)});
}

void flip_bit(const Stream& stream, std::uint32_t* word, int bit) {
  if (bit < 0 || bit > 31) checks::fail({"flip_bit: bit must be in [0, 31], got ", bit});
  checks::present("flip_bit", {{"word", word}});
  launch(stream, "flip_bit", 1, FlipBit{word, std::uint32_t{1} << bit}, {operand(word, 1)});
}

void flip_if_faulty(const Stream& stream, void* output, std::size_t bytes) {
  if (bytes >= sizeof(std::uint32_t) && progress::flip_this_output(stream))
    flip_bit(stream, static_cast<std::uint32_t*>(output), 31);
}

}  // namespace dp::kernels
