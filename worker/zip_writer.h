#pragma once
// Note [Archive writer]
// ~~~~~~~~~~~~~~~~~~~~~
// torch.save's file is a zip archive of stored (uncompressed) records under
// one top directory: `archive/data.pkl`, one `archive/data/<i>` per storage
// and `archive/version` ("3\n", the format PyTorch's writer produces for a
// pickle), each record's data placed at an aligned offset by padding the
// local header's extra field (id "FB", as PyTorch does). Readers — PyTorch's
// PyTorchStreamReader (miniz) in every version, Python's zipfile — find the
// data through the local header, whatever the padding; they check each
// record's CRC-32 when they extract it.
//
// LibTorch's writer (PyTorchStreamWriter over miniz) makes the same archive
// but cannot serve the disk tier at the disk's speed: miniz takes each
// record's CRC-32 with table code, four to five times as long as a memcpy
// of the record (most of a checkpoint's write CPU, taken from training on a
// busy node), and it aligns data to 64 bytes, so an O_DIRECT writer must
// copy every byte into aligned blocks. This writer takes the CRC with
// Crc32 (ISA-L, at memory speed), before the record's header, so no data
// descriptor follows the data; places the data of records of
// kPageAlignedMin bytes or more at 4 KiB offsets (others at 64, as PyTorch);
// and hands a record's data to the sink as it lies, marked `lasting` when
// the caller says the memory outlives the archive, so that a FileWriter
// writes it to the disk straight from there (see Note [Direct writes] in
// worker/checkpoint/file_writer.h). The whole archive's CRC-32 (the
// checkpoint manifest's) comes from the pieces' without a second pass.
//
// ZIP64: a record of 4 GiB or more, or one that starts past 4 GiB, gets
// ZIP64 sizes or offset in its headers, and an archive with a central
// directory past 4 GiB (or 65,535 records) the ZIP64 end records, as the
// format says (APPNOTE 4.3.14, 4.5.3); Options::zip64 writes every header in
// that form, so that tests check readers against it on small archives.
// Torch-free.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace concord {

class ZipWriter {
 public:
  static constexpr size_t kAlign = 64;
  static constexpr size_t kPageAlign = 4096;
  static constexpr size_t kPageAlignedMin = size_t{64} << 10;

  // The archive's next `n` bytes. `lasting`: they are a record's data,
  // valid and unchanged until the sink's owner has finished with the
  // archive, so the sink may keep the pointer instead of copying. `data`
  // null: `n` zero bytes, a hole's (AddHole), which the sink may leave
  // unwritten where zeros read back (a file's sparse hole). False on a
  // failure: the writer stops.
  using Sink = std::function<bool(const void* data, size_t n, bool lasting)>;

  struct Options {
    // Every record's headers and the end records in ZIP64 form, whatever
    // the sizes (for tests; big archives get it where they need it).
    bool zip64 = false;
  };

  // An archive whose records are under `top` ("archive" in torch.save's).
  ZipWriter(std::string top, Sink sink, Options options);
  ZipWriter(std::string top, Sink sink)
      : ZipWriter(std::move(top), std::move(sink), Options()) {}

  // Adds the record `top`/`name`: `n` bytes at `data`, stored. `lasting`:
  // the memory outlives the archive's writing (see Sink). UNAVAILABLE when
  // the sink failed, now or before; FAILED_PRECONDITION after Finish.
  absl::Status Add(std::string_view name, const void* data, size_t n,
                   bool lasting);
  // Adds the record `top`/`name` of `n` bytes whose CRC-32 is `crc` but
  // gives the sink a hole (null data) for it, which another process writes
  // into the file later (see Note [Shards written where they are] in
  // worker/checkpoint/disk.h); crc32() counts the record's real bytes.
  // Returns the data's offset in the archive. Errors as Add's.
  absl::StatusOr<uint64_t> AddHole(std::string_view name, size_t n,
                                   uint32_t crc);
  // Writes the central directory and the end records.
  absl::Status Finish();

  // The bytes written so far and their CRC-32.
  uint64_t size() const { return offset_; }
  uint32_t crc32() const { return crc_; }

 private:
  struct Entry {
    std::string name;
    uint64_t offset;  // of its local header
    uint64_t size;
    uint32_t crc;
  };
  // Writes `bytes` (a header: its CRC is taken here).
  bool Put(const std::string& bytes);
  // Add's header, for `n` bytes of CRC-32 `crc`.
  absl::Status Header(std::string_view name, size_t n, uint32_t crc);
  absl::Status Failed() const;

  const std::string top_;
  const Sink sink_;
  const Options options_;
  std::vector<Entry> entries_;
  uint64_t offset_ = 0;
  uint32_t crc_ = 0;
  bool failed_ = false;
  bool finished_ = false;
};

}  // namespace concord
