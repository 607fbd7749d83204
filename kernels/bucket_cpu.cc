#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "kernels/bucket.h"

namespace concord::kernels {

void FlattenCpu(const BucketSlice* slices, int64_t count, int64_t element_size,
                void* bucket) {
  auto* out = static_cast<char*>(bucket);
  for (int64_t k = 0; k < count; ++k) {
    if (slices[k].numel == 0) continue;
    std::memcpy(out + slices[k].offset * element_size, slices[k].data,
                static_cast<size_t>(slices[k].numel * element_size));
  }
}

void UnflattenCpu(const BucketSlice* slices, int64_t count,
                  int64_t element_size, const void* bucket) {
  const auto* in = static_cast<const char*>(bucket);
  for (int64_t k = 0; k < count; ++k) {
    if (slices[k].numel == 0) continue;
    std::memcpy(slices[k].data, in + slices[k].offset * element_size,
                static_cast<size_t>(slices[k].numel * element_size));
  }
}

namespace {

// Element-wise casts with one type pair per loop (no switch inside), so that
// the compiler vectorises them (this library is built with -O3).
template <typename Convert, typename Src, typename Dst>
void CastLoop(const Src* src, Dst* dst, int64_t n, Convert convert) {
  for (int64_t i = 0; i < n; ++i) dst[i] = convert(src[i]);
}

#if defined(__x86_64__) && defined(__GNUC__)
// float <-> half with the F16C instructions where the processor has them
// (what LibTorch's vectorised casts use): round to nearest even, the same
// bits as FloatToHalfBits / HalfBitsToFloat for every input (exhaustively
// checked: all 2^32 floats, all 2^16 halfs), once the lanes holding a NaN are
// redone by FloatToHalfBits (the instruction keeps NaN payloads, the twins
// and the CUDA kernels give sign|0x7E00).
__attribute__((target("avx,f16c"))) void FloatToHalfF16c(const float* src,
                                                         uint16_t* dst,
                                                         int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(src + i);
    const __m128i h =
        _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
    if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) != 0) {
      for (int64_t k = i; k < i + 8; ++k) dst[k] = FloatToHalfBits(src[k]);
    }
  }
  for (; i < n; ++i) dst[i] = FloatToHalfBits(src[i]);
}

__attribute__((target("avx,f16c"))) void HalfToFloatF16c(const uint16_t* src,
                                                         float* dst,
                                                         int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                  reinterpret_cast<const __m128i*>(src + i))));
  }
  for (; i < n; ++i) dst[i] = HalfBitsToFloat(src[i]);
}

bool HasF16c() {
  static const bool has =
      __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return has;
}
#endif

}  // namespace

void CastCpu(const void* src, DType src_type, void* dst, DType dst_type,
             int64_t n) {
  if (n <= 0) return;
  if (src_type == dst_type) {
    std::memcpy(dst, src, static_cast<size_t>(n * DTypeSize(src_type)));
    return;
  }
  const auto* f32_in = static_cast<const float*>(src);
  const auto* u16_in = static_cast<const uint16_t*>(src);
  auto* f32_out = static_cast<float*>(dst);
  auto* u16_out = static_cast<uint16_t*>(dst);
  using D = DType;
  if (src_type == D::kFloat32 && dst_type == D::kFloat16) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (HasF16c()) return FloatToHalfF16c(f32_in, u16_out, n);
#endif
    return CastLoop(f32_in, u16_out, n, FloatToHalfBits);
  }
  if (src_type == D::kFloat16 && dst_type == D::kFloat32) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (HasF16c()) return HalfToFloatF16c(u16_in, f32_out, n);
#endif
    return CastLoop(u16_in, f32_out, n, HalfBitsToFloat);
  }
  if (src_type == D::kFloat32 && dst_type == D::kBFloat16) {
    return CastLoop(f32_in, u16_out, n, FloatToBf16Bits);
  }
  if (src_type == D::kBFloat16 && dst_type == D::kFloat32) {
    return CastLoop(u16_in, f32_out, n, Bf16BitsToFloat);
  }
  if (src_type == D::kFloat16) {  // to bfloat16
    return CastLoop(u16_in, u16_out, n, [](uint16_t h) {
      return FloatToBf16Bits(HalfBitsToFloat(h));
    });
  }
  // bfloat16 to half.
  CastLoop(u16_in, u16_out, n,
           [](uint16_t b) { return FloatToHalfBits(Bf16BitsToFloat(b)); });
}

}  // namespace concord::kernels
