#pragma once
// Element types the kernels take, and the host-side conversions the CPU
// twins use. The conversions round to nearest even exactly as c10::Half and
// c10::BFloat16 (and CUDA's __float2half_rn / __float2bfloat16_rn) do, so a
// CPU twin and its CUDA kernel agree bit for bit on every cast.

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace concord::kernels {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

inline int64_t DTypeSize(DType t) { return t == DType::kFloat32 ? 4 : 2; }

// Calls f(std::integral_constant<DType, D>) for `dtype`: a kernel or a CPU
// twin's inner loop then loads with a fixed type instead of switching per
// element. Host code (nvcc compiles it for the launches too).
template <typename F>
void DispatchDType(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat16:
      f(std::integral_constant<DType, DType::kFloat16>{});
      break;
    case DType::kBFloat16:
      f(std::integral_constant<DType, DType::kBFloat16>{});
      break;
    case DType::kFloat32:
    default:
      f(std::integral_constant<DType, DType::kFloat32>{});
      break;
  }
}

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

// Note [Integer conversions]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// The same four conversions on bit patterns, with integer operations only,
// bit-identical to the functions above for every input (kernels_test checks
// all 2^16 halfs and bf16s and a sweep of floats). The CUDA kernels use these
// rather than __float2half_rn and friends: the hardware conversions give a
// canonical NaN (0x7FFF) where the twins (and c10 on the CPU) give sign|0x7E00
// for half and 0x7FC0 for bf16, and no float instruction is involved here
// that flushing subnormals, contracting or canonicalising NaNs could change.
// A NaN read from half is quieted with its payload kept, as the CPUs'
// float multiply in HalfBitsToFloat does.
#if defined(__CUDACC__)
#define CONCORD_HOST_DEVICE __host__ __device__
#else
#define CONCORD_HOST_DEVICE
#endif
namespace bits {

CONCORD_HOST_DEVICE inline uint32_t HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  if (exp == 0x1Fu) {  // inf, or NaN (quieted)
    return sign | 0x7F800000u | (mant << 13) | (mant != 0 ? 0x00400000u : 0u);
  }
  if (exp != 0) return sign | ((exp + 112u) << 23) | (mant << 13);
  if (mant == 0) return sign;  // +-0
  // Subnormal half: normalise (a normal float).
  uint32_t e = 113;
  while ((mant & 0x400u) == 0) {
    mant <<= 1;
    --e;
  }
  return sign | (e << 23) | ((mant & 0x3FFu) << 13);
}

CONCORD_HOST_DEVICE inline uint16_t FloatToHalf(uint32_t w) {
  const uint32_t sign = (w >> 16) & 0x8000u;
  const uint32_t u = w & 0x7FFFFFFFu;
  if (u > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);  // NaN
  // 65520 (0x477FF000) and above round to infinity.
  if (u >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);
  uint32_t result, rem, halfway;
  if (u >= 0x38800000u) {  // a normal half: rebias 127 -> 15
    const uint32_t v = u - 0x38000000u;
    result = v >> 13;
    rem = v & 0x1FFFu;
    halfway = 0x1000u;
  } else if (u <= 0x33000000u) {  // at most 2^-25: rounds to +-0
    return static_cast<uint16_t>(sign);
  } else {  // a subnormal half (or the smallest normal, by rounding)
    const uint32_t exp = u >> 23;  // 102..112
    const uint32_t mant = (u & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126u - exp;  // 14..24
    result = mant >> shift;
    rem = mant & ((1u << shift) - 1u);
    halfway = 1u << (shift - 1u);
  }
  if (rem > halfway || (rem == halfway && (result & 1u) != 0)) ++result;
  return static_cast<uint16_t>(sign | result);
}

CONCORD_HOST_DEVICE inline uint32_t Bf16ToFloat(uint16_t b) {
  return static_cast<uint32_t>(b) << 16;
}

CONCORD_HOST_DEVICE inline uint16_t FloatToBf16(uint32_t u) {
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  // NaN
  const uint32_t rounding_bias = ((u >> 16) & 1u) + 0x7FFFu;
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

}  // namespace bits

#if defined(__CUDACC__)
// Device element access for the CUDA kernels: Elem<D>::T is the storage type
// of DType D; Load widens to float and Store narrows (round to nearest even),
// bit for bit as LoadAsFloat / StoreFromFloat (see Note [Integer conversions]).
template <DType D>
struct Elem;
template <>
struct Elem<DType::kFloat32> {
  using T = float;
  __device__ static float Load(T v) { return v; }
  __device__ static T Store(float v) { return v; }
};
template <>
struct Elem<DType::kFloat16> {
  using T = uint16_t;
  __device__ static float Load(T v) {
    return __uint_as_float(bits::HalfToFloat(v));
  }
  __device__ static T Store(float v) {
    return bits::FloatToHalf(__float_as_uint(v));
  }
};
template <>
struct Elem<DType::kBFloat16> {
  using T = uint16_t;
  __device__ static float Load(T v) {
    return __uint_as_float(bits::Bf16ToFloat(v));
  }
  __device__ static T Store(float v) {
    return bits::FloatToBf16(__float_as_uint(v));
  }
};
#endif

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
