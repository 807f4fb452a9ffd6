// dtype.hpp — the element types shardlm moves between memories and over the
// wire, and the scalar conversions between them.
//
// Owns: DType (what a collective or a gradient accumulation carries) and the
// exact bf16/fp16 <-> fp32 conversions that the GPU code, the offload pipeline,
// checkpoints and safetensors share. Knows nothing else.
#pragma once

#include <bit>
#include <cstdint>

namespace shardlm {

enum class DType { F32, BF16 };
inline int64_t dtype_bytes(DType t) { return t == DType::F32 ? 4 : 2; }

// Exact: bf16 is the top half of an fp32.
inline float bf16_to_f32(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

// Round to nearest, ties to even; NaN stays a (quiet) NaN of the same sign,
// values past the bf16 range round to +-inf.
inline uint16_t f32_to_bf16_rne(float value) {
  uint32_t u = std::bit_cast<uint32_t>(value);
  // NaN: truncation could clear every mantissa bit and make an inf; keep the
  // sign and top payload bits and force the quiet bit.
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  // Adding 0x7fff (+1 when the kept lsb is odd) carries into the kept bits
  // exactly when the dropped half is above the tie, or at the tie with odd lsb.
  // A carry out of the largest finite exponent gives inf, which is RNE's answer.
  uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

// Exact for every half value: normals, subnormals, +-0, +-inf, NaN (payload kept).
inline float f16_to_f32(uint16_t bits) {
  uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  uint32_t exponent = (bits >> 10) & 0x1fu;
  uint32_t mantissa = bits & 0x3ffu;
  uint32_t out;
  if (exponent == 0x1f) {                 // inf / NaN, payload kept
    out = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {             // normal: rebias 15 -> 127
    out = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {             // +-0
    out = sign;
  } else {                                // subnormal: normalise (every one is normal in fp32)
    uint32_t e = 113;                     // 127 - 15 + 1
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --e;
    }
    out = sign | (e << 23) | ((mantissa & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(out);
}

}  // namespace shardlm
