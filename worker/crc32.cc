#include "worker/crc32.h"

#include <isa-l/crc.h>
#include <zlib.h>

namespace concord {

uint32_t Crc32(uint32_t crc, const void* data, size_t n) {
  return crc32_gzip_refl(crc, static_cast<const unsigned char*>(data), n);
}

// A record may pass 4 GiB: zlib's offsets must be 64-bit (they are on LP64).
static_assert(sizeof(z_off_t) >= sizeof(uint64_t));

uint32_t Crc32Combine(uint32_t a, uint32_t b, uint64_t b_bytes) {
  return static_cast<uint32_t>(
      crc32_combine(a, b, static_cast<z_off_t>(b_bytes)));
}

}  // namespace concord
