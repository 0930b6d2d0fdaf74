// dp/kernels/portable_math.h — exp, log, erf and tanh for fp32 in the same bits on host and device.
// The platform's expf, logf, erff and tanhf differ between glibc and CUDA's libdevice in the last
// bit, so a kernel that called them would give cuda and sim other bits. These are written with
// correctly rounded operations only (fmaf, +, -, *, /, rintf, selects), which both compilers honour
// as written (-ffp-contract=off, --fmad=false), and without branches on the value where they sit in
// elementwise loops, so the host vectorises those loops (glibc's calls keep them scalar).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

#include "dp/kernels/platform.h"

namespace dp::kernels {

// c0 x^n + c1 x^(n-1) + ... + cn by Horner's rule, one fmaf a step: straight-line code (a fold, not
// a loop), the same steps on both backends, and a loop around it still vectorises.
template <class... C>
DP_HD inline float horner(float x, float c0, C... c) {
  float p = c0;
  ((p = fmaf(p, x, c)), ...);
  return p;
}

// 2^n for n in [-126, 127], from its bits.
DP_HD inline float pow2_bits(int n) {
  const auto bits = static_cast<std::uint32_t>(n + 127) << 23;
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  return std::bit_cast<float>(bits);
#endif
}

// fmaxf's value (a NaN operand gives the other one) as a compare and a select: on the host fmaxf is
// a libm call per element, which also keeps a loop around it scalar. Of +0 and -0 either may come
// back, as from fmaxf: a running max's sign of zero changes neither an exponent's argument (x - m)
// nor a log-sum-exp (m + log(sum), the log >= +0).
DP_HD inline float max_portable(float a, float b) { return a > b || b != b ? a : b; }

// e^x for fp32 in the same bits on host and device: the platform's expf differs between glibc and
// CUDA's libdevice in the last bit. Cody-Waite reduction x = n ln2 + r (ln2 split in two so n ln2 is
// exact), Cephes' degree-6 polynomial for e^r on |r| <= ln2/2 (within 2 ulps of e^x), then e^r 2^n
// as two products by powers of two: the first exact, the second rounding once, so the result is
// e^r 2^n correctly rounded (ldexpf's) without a library call. Every step is a correctly rounded
// operation that both compilers honour as written; no branch, so the host vectorises it over a tile.
DP_HD inline float exp_portable(float x) {
  // Every comparison made once and unconditionally, the rest selects (not fminf, a libm call on the
  // host), so the host vectorises the loop over a tile. NaN is computed as the lower bound and
  // replaced at the end.
  const bool nan = x != x, below = x<-103.972084045410156f, above = x> 88.72283935546875f;
  float xc = below ? -103.972084045410156f : x;
  xc = above ? 88.72283935546875f : xc;
  xc = nan ? -103.972084045410156f : xc;
  const float n = rintf(mul_unfused(xc, 1.44269502162933349609f));
  float r = fmaf(-n, 0.693359375f, xc);
  r = fmaf(-n, -2.12194440e-4f, r);
  const float p = horner(r, 1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                         5.0000001201e-1f);
  const float e = fmaf(p, mul_unfused(r, r), r) + 1.0f;  // in [0.7, 1.42]
  const int ni = static_cast<int>(n), half = ni / 2;     // ni in [-150, 128]: both halves in [-75, 64]
  const float scaled = mul_unfused(mul_unfused(e, pow2_bits(half)), pow2_bits(ni - half));
  float result = below ? 0.0f : scaled;
  result = above ? INFINITY : result;
  return nan ? x : result;
}

// log x for fp32 in the same bits on host and device (Cephes' logf: x = f 2^e with f in
// [sqrt(1/2), sqrt(2)), a degree-9 polynomial in f - 1, e ln2 added in two parts), within 2 ulps.
DP_HD inline float log_portable(float x) {
  if (!(x > 0.0f) || x == INFINITY) return x == 0.0f ? -INFINITY : (x == INFINITY ? x : NAN);
  int e = 0;
  float f = frexpf(x, &e);  // [0.5, 1)
  if (f < 0.707106781186547524f) {
    e -= 1;
    f = f + f - 1.0f;
  } else {
    f = f - 1.0f;
  }
  const float z = mul_unfused(f, f);
  const float p = horner(f, 7.0376836292e-2f, -1.1514610310e-1f, 1.1676998740e-1f, -1.2420140846e-1f, 1.4249322787e-1f,
                         -1.6668057665e-1f, 2.0000714765e-1f, -2.4999993993e-1f, 3.3333331174e-1f);
  const float ef = static_cast<float>(e);
  float y = mul_unfused(mul_unfused(p, f), z);
  y = fmaf(ef, -2.12194440e-4f, y);
  y = fmaf(-0.5f, z, y);
  return fmaf(ef, 0.693359375f, f + y);
}

// erf x within 2 ulps (1.74 at most over [0, 5], 0.25 on average; glibc's erff: 0.9). |x| <= 1.25:
// x (2/sqrt(pi) + x^2 Q(x^2)), the constant split in two floats so that the leading term rounds
// once; 1.25 < |x| < 4: 1 - e^-x^2 R(1/x^2) / |x| (R the fitted x e^x^2 erfc x, x^2 = hi + lo
// exactly, e^-lo as 1 - lo); beyond, +-1 (erf 3.92 already rounds to 1). Q and R are least-squares
// fits on Chebyshev nodes (relative error 4e-10 and 9e-8). Both forms computed, one selected.
DP_HD inline float erf_portable(float x) {
  const float a = fabsf(x), s = mul_unfused(x, x);
  const float q = horner(s, 7.954824818e-07f, -1.258490035e-05f, 1.167793322e-04f, -8.511036158e-04f, 5.221710291e-03f,
                         -2.686534994e-02f, 1.128377537e-01f, -3.761263741e-01f);
  const float small =
      fmaf(x, 1.12837922573089599609375f, fmaf(x, -5.863538344e-08f, mul_unfused(mul_unfused(x, s), q)));
  float c = a < 1.25f ? 1.25f : a;
  c = a > 4.0f ? 4.0f : c;
  const float hi = mul_unfused(c, c), lo = fmaf(c, c, -hi);
  const float t = 1.0f / hi;
  const float r = horner(t, -1.163605855e+00f, 4.228268519e+00f, -6.840567194e+00f, 6.580511298e+00f, -4.293813166e+00f,
                         2.112355692e+00f, -8.995265556e-01f, 4.123669541e-01f, -2.816637370e-01f, 5.641820957e-01f);
  const float tail = mul_unfused(exp_portable(-hi), 1.0f - lo);
  float big = 1.0f - mul_unfused(tail, r) / c;
  big = a >= 4.0f ? 1.0f : big;
  big = x < 0.0f ? -big : big;
  const float out = a <= 1.25f ? small : big;
  return x != x ? x : out;
}

// tanh x within 2 ulps (1.31 at most over [0, 10]; glibc's tanhf: 2.16). |x| < 0.625:
// x + x^3 P(x^2) (a least-squares fit, relative error 1e-8); beyond, 1 - 2 / (e^2|x| + 1) with the
// sign of x (+-1 once e^2|x| overflows). Both forms computed, one selected.
DP_HD inline float tanh_portable(float x) {
  const float a = fabsf(x), s = mul_unfused(x, x);
  const float p = horner(s, 2.303796420e-03f, -8.352449709e-03f, 2.177084410e-02f, -5.395933054e-02f, 1.333330205e-01f,
                         -3.333333310e-01f);
  const float small = fmaf(mul_unfused(x, s), p, x);
  float big = 1.0f - 2.0f / (exp_portable(a + a) + 1.0f);
  big = x < 0.0f ? -big : big;
  const float out = a < 0.625f ? small : big;
  return x != x ? x : out;
}

}  // namespace dp::kernels
