// dp/runtime/precision.h — how exact the GPU libraries must be: a per-runtime policy (RuntimeOptions::precision)
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
// tf32: `fast`, and TF32 matmuls too (torch.backends.cuda.matmul.allow_tf32 = True): cuBLAS runs
//   its GEMMs on TF32 tensor cores (CUBLAS_TF32_TENSOR_OP_MATH), which take each fp32 operand with
//   10 mantissa bits instead of 23 and accumulate in fp32. The sim computes the same: it rounds both
//   GEMM operands to TF32 (kernels::round_to_tf32) and multiplies them in fp32, exactly (a product
//   of two TF32 values fits an fp32 mantissa), so only the accumulation order differs from the GPU.
// The sim backend has one arithmetic for strict and fast: `fast` computes exactly what `strict`
// does there.
enum class Precision { strict, fast, tf32 };

// "strict", "fast", "tf32".
std::string_view to_string(Precision precision);
// The inverse of to_string; throws InvalidArgument naming the text and the accepted values.
Precision parse_precision(std::string_view text);

// Automatic mixed precision, as torch.autocast(dtype=torch.bfloat16) around a model's forward (and
// so its backward): Linear and Conv2d multiply bf16-rounded inputs and weights with fp32
// accumulation and give bf16 outputs; the layers after them run on those bf16 tensors; the loss is
// fp32; parameters, gradients and optimizer state stay fp32 (master weights). A model-level
// setting (Model::set_autocast), independent of Precision.
enum class Autocast { off, bf16 };

// "off", "bf16".
std::string_view to_string(Autocast autocast);
// The inverse of to_string; throws InvalidArgument naming the text and the accepted values.
Autocast parse_autocast(std::string_view text);

}  // namespace dp
