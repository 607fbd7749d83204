#pragma once
// CRC-32 as zlib, gzip and zip take it (the reflected IEEE 802.3
// polynomial), at memory speed: ISA-L's carry-less-multiply code
// (PCLMULQDQ), about the time of a memcpy of the same bytes, where zlib's and
// miniz's table code takes four to five times as long (bench/checkpoint.cc:
// crc32_s against crc32_zlib_s). Torch-free.

#include <cstddef>
#include <cstdint>

namespace concord {

// The CRC-32 of the bytes that gave `crc` followed by `n` bytes at `data`
// (start with 0): zlib's crc32(crc, data, n).
uint32_t Crc32(uint32_t crc, const void* data, size_t n);

// The CRC-32 of A followed by B from A's and B's, B `b_bytes` long (zlib's
// crc32_combine): a file's CRC from its pieces' without a second pass.
uint32_t Crc32Combine(uint32_t a, uint32_t b, uint64_t b_bytes);

}  // namespace concord
