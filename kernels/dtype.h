#pragma once
// Element types the kernels take, and the host-side conversions the CPU
// twins use. The conversions round to nearest even exactly as c10::Half and
// c10::BFloat16 (and CUDA's __float2half_rn / __float2bfloat16_rn) do, so a
// CPU twin and its CUDA kernel agree bit for bit on every cast.

#include <cstdint>
#include <cstring>

namespace concord::kernels {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

inline int64_t DTypeSize(DType t) { return t == DType::kFloat32 ? 4 : 2; }

namespace detail {
inline float FloatFromBits(uint32_t w) {
  float f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}
inline uint32_t BitsFromFloat(float f) {
  uint32_t w;
  std::memcpy(&w, &f, sizeof(w));
  return w;
}
}  // namespace detail

// IEEE half <-> float (the FP16 library's branch-free algorithms, as c10).
inline float HalfBitsToFloat(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = 0xE0u << 23;
  const float normalized =
      detail::FloatFromBits((two_w >> 4) + exp_offset) * 0x1.0p-112f;
  const uint32_t magic_mask = 126u << 23;
  const float denormalized =
      detail::FloatFromBits((two_w >> 17) | magic_mask) - 0.5f;
  const uint32_t cutoff = 1u << 27;
  return detail::FloatFromBits(
      sign | (two_w < cutoff ? detail::BitsFromFloat(denormalized)
                             : detail::BitsFromFloat(normalized)));
}

inline uint16_t FloatToHalfBits(float f) {
  float base = (f < 0 ? -f : f) * 0x1.0p+112f * 0x1.0p-110f;
  const uint32_t w = detail::BitsFromFloat(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = detail::FloatFromBits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = detail::BitsFromFloat(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) |
                               (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

inline float Bf16BitsToFloat(uint16_t b) {
  return detail::FloatFromBits(static_cast<uint32_t>(b) << 16);
}

inline uint16_t FloatToBf16Bits(float f) {
  if (f != f) return 0x7FC0;  // NaN
  const uint32_t u = detail::BitsFromFloat(f);
  const uint32_t rounding_bias = ((u >> 16) & 1u) + 0x7FFFu;
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

// Element i of a buffer of type `t`, widened to float.
inline float LoadAsFloat(const void* data, DType t, int64_t i) {
  switch (t) {
    case DType::kFloat16:
      return HalfBitsToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kBFloat16:
      return Bf16BitsToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kFloat32:
    default:
      return static_cast<const float*>(data)[i];
  }
}

// Stores `v` rounded to type `t` at element i.
inline void StoreFromFloat(void* data, DType t, int64_t i, float v) {
  switch (t) {
    case DType::kFloat16:
      static_cast<uint16_t*>(data)[i] = FloatToHalfBits(v);
      break;
    case DType::kBFloat16:
      static_cast<uint16_t*>(data)[i] = FloatToBf16Bits(v);
      break;
    case DType::kFloat32:
    default:
      static_cast<float*>(data)[i] = v;
      break;
  }
}

}  // namespace concord::kernels
