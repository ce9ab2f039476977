// Counter-based Gumbel noise shared by the C++ CPU and CUDA kernels (and mirrored in fastrag/signals/reference.py
// `mix32` / `sampling_uniform_ref` and kernels/token_signals.py): u[b, v] = ((mix32(key_b ^ mix32(v)) >> 9) + 0.5)
// * 2^-23, g = -ln(-ln u). Same key and logits -> same sampled token on every backend, no RNG state on the device.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FASTRAG_HD __host__ __device__ __forceinline__
#else
#define FASTRAG_HD inline
#endif

namespace fastrag {

FASTRAG_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// Uniform in [2^-24, 1 - 2^-24]: a 23-bit integer + 0.5 has 24 significant bits, so the sum is exact in float32
// (a 24-bit integer + 0.5 would round, its largest value to 2^24, i.e. u = 1 and an infinite Gumbel score).
FASTRAG_HD float sampling_uniform(uint32_t key, uint32_t v) {
  return (static_cast<float>(mix32(key ^ mix32(v)) >> 9) + 0.5f) * 1.1920928955078125e-07f;
}

}  // namespace fastrag
