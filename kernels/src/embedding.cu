// embedding.cu — launchers for dp/kernels/embedding.h: a gather forward; the weight gradient as a
// stable counting sort of the tokens by id (count, scan, place) and one sum per (id, column).
#include <limits>

#include "checks.h"
#include "dp/kernels/detail/launch.h"
#include "dp/kernels/embedding.h"

namespace dp::kernels {
namespace {

void check_embedding(const char* op, index_t tokens, index_t vocab, index_t dim) {
  if (tokens < 0 || vocab < 1 || dim < 1 || tokens > std::numeric_limits<std::int32_t>::max() ||
      vocab > std::numeric_limits<std::int32_t>::max())
    checks::fail(
        {op, ": need 0 <= tokens < 2^31, 1 <= vocab < 2^31 and dim >= 1, got tokens=", static_cast<long long>(tokens),
         " vocab=", static_cast<long long>(vocab), " dim=", static_cast<long long>(dim)});
}

}  // namespace

void embedding_forward(const Stream& stream, index_t tokens, index_t vocab, index_t dim, const std::int32_t* ids,
                       const float* weight, float* y) {
  const char* op = "embedding_forward";
  check_embedding(op, tokens, vocab, dim);
  checks::present(op, {{"ids", ids}, {"weight", weight}, {"y", y}});
  launch_2d(stream, op, tokens, dim, EmbeddingGather{vocab, dim, ids, weight, y},
            {operand(ids, tokens), operand(weight, vocab * dim), operand(y, tokens * dim)});
  if (stream.backend() == Backend::sim) {
    // torch's "index out of range in self", checked where the ids are host memory in stream order.
    // Queued after the gather (which writes NaN for such a row, as on cuda), so what the gather
    // writes does not depend on when the failure is noticed: a later launch would be refused.
    kernel_api::enqueue_host(stream, "embedding_check_ids", [ids, tokens, vocab] {
      for (index_t t = 0; t < tokens; ++t)
        if (ids[t] < 0 || ids[t] >= vocab)
          checks::fail({"embedding_forward: token ", static_cast<long long>(t), " has id ", ids[t],
                        ", outside the vocabulary [0, ", static_cast<long long>(vocab), ")"});
    });
  }
}

void embedding_backward(const Stream& stream, index_t tokens, index_t vocab, index_t dim, const std::int32_t* ids,
                        const float* dy, float* dweight, std::int32_t* order, std::int32_t* offsets, bool accumulate) {
  const char* op = "embedding_backward";
  check_embedding(op, tokens, vocab, dim);
  checks::present(op, {{"ids", ids}, {"dy", dy}, {"dweight", dweight}, {"order", order}, {"offsets", offsets}});
  launch(stream, "embedding_count", vocab, EmbeddingCount{tokens, ids, offsets},
         {operand(ids, tokens), operand(offsets, vocab + 1)});
  launch(stream, "embedding_scan", 1, EmbeddingScan{vocab, offsets}, {operand(offsets, vocab + 1)});
  launch(stream, "embedding_order", vocab, EmbeddingOrder{tokens, ids, offsets, order},
         {operand(ids, tokens), operand(offsets, vocab + 1), operand(order, tokens)});
  launch_2d(
      stream, op, vocab, dim, EmbeddingGradRows{dim, order, offsets, dy, dweight, accumulate},
      {operand(order, tokens), operand(offsets, vocab + 1), operand(dy, tokens * dim), operand(dweight, vocab * dim)});
}

void add_positions(const Stream& stream, index_t batch, index_t tokens, index_t dim, const float* positions, float* y) {
  if (batch < 0 || tokens < 1 || dim < 1)
    checks::fail({"add_positions: need batch >= 0, tokens and dim >= 1, got batch=", static_cast<long long>(batch),
                  " tokens=", static_cast<long long>(tokens), " dim=", static_cast<long long>(dim)});
  launch_2d(stream, "add_positions", batch * tokens, dim, AddPositions{tokens, dim, positions, y},
            {operand(positions, tokens * dim), operand(y, batch * tokens * dim)});
}

}  // namespace dp::kernels
