#include "worker/zip_writer.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/crc32.h"

namespace concord {
namespace {

// The format's fields (APPNOTE.TXT 4.3, 4.5.3); little-endian throughout.
constexpr uint32_t kLocalHeader = 0x04034b50;
constexpr uint32_t kCentralHeader = 0x02014b50;
constexpr uint32_t kZip64End = 0x06064b50;
constexpr uint32_t kZip64Locator = 0x07064b50;
constexpr uint32_t kEnd = 0x06054b50;
constexpr uint16_t kZip64Field = 0x0001;
constexpr uint16_t kPaddingField = 0x4246;  // "FB", PyTorch's
constexpr uint16_t kVersion = 20;           // 2.0: stored records
constexpr uint16_t kVersionZip64 = 45;      // 4.5: ZIP64
// 1980-01-01 00:00, the format's first day: the same state gives the same
// bytes (PyTorch's writer stamps the same).
constexpr uint16_t kDosDate = (1 << 5) | 1;
constexpr uint64_t kMax16 = 0xFFFF;
constexpr uint64_t kMax32 = 0xFFFFFFFF;
constexpr size_t kLocalFixed = 30;  // a local header before its name

void Le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i)
    out.push_back(static_cast<char>(v >> (8 * i)));
}

}  // namespace

ZipWriter::ZipWriter(std::string top, Sink sink, Options options)
    : top_(std::move(top)), sink_(std::move(sink)), options_(options) {}

absl::Status ZipWriter::Failed() const {
  return absl::UnavailableError("the archive's write failed");
}

bool ZipWriter::Put(const std::string& bytes) {
  if (!sink_(bytes.data(), bytes.size(), /*lasting=*/false)) {
    failed_ = true;
    return false;
  }
  crc_ = Crc32(crc_, bytes.data(), bytes.size());
  offset_ += bytes.size();
  return true;
}

absl::Status ZipWriter::Header(std::string_view name, size_t n, uint32_t crc) {
  if (finished_) {
    return absl::FailedPreconditionError("the archive is finished");
  }
  if (failed_) return Failed();
  std::string path = top_ + "/" + std::string(name);
  if (path.size() > kMax16) {
    return absl::InvalidArgumentError(
        absl::StrCat("a record's name is ", path.size(), " bytes long"));
  }
  const bool zip64 = options_.zip64 || n >= kMax32;

  // The padding field's length puts the data at the alignment.
  const size_t extra_fixed = (zip64 ? 20 : 0) + 4;
  const size_t align = n >= kPageAlignedMin ? kPageAlign : kAlign;
  const uint64_t unpadded = offset_ + kLocalFixed + path.size() + extra_fixed;
  const size_t pad = (align - unpadded % align) % align;

  std::string h;
  Le(h, kLocalHeader, 4);
  Le(h, zip64 ? kVersionZip64 : kVersion, 2);
  Le(h, 0, 2);  // flags: no data descriptor, the CRC is here
  Le(h, 0, 2);  // stored
  Le(h, 0, 2);  // time
  Le(h, kDosDate, 2);
  Le(h, crc, 4);
  Le(h, zip64 ? kMax32 : n, 4);  // compressed size
  Le(h, zip64 ? kMax32 : n, 4);  // uncompressed size
  Le(h, path.size(), 2);
  Le(h, extra_fixed + pad, 2);
  h += path;
  if (zip64) {
    Le(h, kZip64Field, 2);
    Le(h, 16, 2);
    Le(h, n, 8);
    Le(h, n, 8);
  }
  Le(h, kPaddingField, 2);
  Le(h, pad, 2);
  h.append(pad, 'Z');

  entries_.push_back({std::move(path), offset_, n, crc});
  if (!Put(h)) return Failed();
  return absl::OkStatus();
}

absl::Status ZipWriter::Add(std::string_view name, const void* data, size_t n,
                            bool lasting) {
  const uint32_t crc = Crc32(0, data, n);
  CONCORD_RETURN_IF_ERROR(Header(name, n, crc));
  if (n > 0) {
    if (!sink_(data, n, lasting)) {
      failed_ = true;
      return Failed();
    }
    crc_ = Crc32Combine(crc_, crc, n);
    offset_ += n;
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> ZipWriter::AddHole(std::string_view name, size_t n,
                                            uint32_t crc) {
  CONCORD_RETURN_IF_ERROR(Header(name, n, crc));
  const uint64_t at = offset_;
  if (n > 0 && !sink_(nullptr, n, /*lasting=*/false)) {
    failed_ = true;
    return Failed();
  }
  crc_ = Crc32Combine(crc_, crc, n);
  offset_ += n;
  return at;
}

absl::Status ZipWriter::Finish() {
  if (finished_) {
    return absl::FailedPreconditionError("the archive is finished");
  }
  if (failed_) return Failed();
  finished_ = true;
  const uint64_t cd_offset = offset_;
  std::string cd;
  for (const Entry& e : entries_) {
    const bool big = options_.zip64 || e.size >= kMax32;
    const bool far = options_.zip64 || e.offset >= kMax32;
    std::string extra;
    if (big || far) {
      // The ZIP64 field holds, in this order, the fields set to all ones.
      Le(extra, kZip64Field, 2);
      Le(extra, (big ? 16 : 0) + (far ? 8 : 0), 2);
      if (big) {
        Le(extra, e.size, 8);
        Le(extra, e.size, 8);
      }
      if (far) Le(extra, e.offset, 8);
    }
    Le(cd, kCentralHeader, 4);
    Le(cd, kVersionZip64, 2);  // made by
    Le(cd, big || far ? kVersionZip64 : kVersion, 2);
    Le(cd, 0, 2);  // flags
    Le(cd, 0, 2);  // stored
    Le(cd, 0, 2);  // time
    Le(cd, kDosDate, 2);
    Le(cd, e.crc, 4);
    Le(cd, big ? kMax32 : e.size, 4);
    Le(cd, big ? kMax32 : e.size, 4);
    Le(cd, e.name.size(), 2);
    Le(cd, extra.size(), 2);
    Le(cd, 0, 2);  // comment
    Le(cd, 0, 2);  // disk
    Le(cd, 0, 2);  // internal attributes
    Le(cd, 0, 4);  // external attributes
    Le(cd, far ? kMax32 : e.offset, 4);
    cd += e.name;
    cd += extra;
  }
  if (!Put(cd)) return Failed();
  const uint64_t cd_size = offset_ - cd_offset;
  const uint64_t count = entries_.size();

  std::string end;
  const bool zip64 = options_.zip64 || count >= kMax16 || cd_offset >= kMax32 ||
                     cd_size >= kMax32;
  if (zip64) {
    const uint64_t record = offset_;
    Le(end, kZip64End, 4);
    Le(end, 44, 8);  // the record's size after this field
    Le(end, kVersionZip64, 2);
    Le(end, kVersionZip64, 2);
    Le(end, 0, 4);  // this disk
    Le(end, 0, 4);  // the central directory's disk
    Le(end, count, 8);
    Le(end, count, 8);
    Le(end, cd_size, 8);
    Le(end, cd_offset, 8);
    Le(end, kZip64Locator, 4);
    Le(end, 0, 4);  // the record's disk
    Le(end, record, 8);
    Le(end, 1, 4);  // disks
  }
  // With the ZIP64 records, a field too small for its value (every field,
  // when forced) holds all ones.
  auto fit = [&](uint64_t v, uint64_t max) {
    return options_.zip64 || v >= max ? max : v;
  };
  Le(end, kEnd, 4);
  Le(end, 0, 2);
  Le(end, 0, 2);
  Le(end, fit(count, kMax16), 2);
  Le(end, fit(count, kMax16), 2);
  Le(end, fit(cd_size, kMax32), 4);
  Le(end, fit(cd_offset, kMax32), 4);
  Le(end, 0, 2);  // comment
  if (!Put(end)) return Failed();
  return absl::OkStatus();
}

}  // namespace concord
