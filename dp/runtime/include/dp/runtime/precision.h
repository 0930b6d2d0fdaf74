// dp/precision.h — how exact the GPU libraries must be: a per-runtime policy (RuntimeOptions::precision)
// that the cuDNN convolutions read when they choose their algorithms.
#pragma once

#include <string_view>

namespace dp {

// strict (the default): results within fp32 rounding of the host path, run to run identical. cuDNN
//   may only use algorithms that compute plain fp32 dot products (FMA math: no TF32, no FFT or
//   Winograd transforms), deterministic ones for the backward passes; among those the fastest one
//   measured (cudnnFind*Ex) is used. cuBLAS runs pedantic fp32.
// fast: PyTorch's defaults (torch.backends.cudnn.benchmark = True, deterministic = False,
//   allow_tf32 = True for convolutions): the fastest cuDNN algorithm measured over all of them,
//   TF32 tensor-core math and nondeterministic (atomic-add) backward algorithms allowed. Results
//   then differ from the host path by TF32 rounding (about 1e-3 relative) and from run to run.
//   GEMMs stay fp32, as PyTorch's matmul default (allow_tf32 = False for matmul) keeps them.
// The sim backend has one arithmetic: `fast` computes exactly what `strict` does there.
enum class Precision { strict, fast };

// "strict", "fast".
std::string_view to_string(Precision precision);
// The inverse of to_string; throws InvalidArgument naming the text and the accepted values.
Precision parse_precision(std::string_view text);

}  // namespace dp
