// The archive writer's ZIP64 form where sizes and offsets need it (see Note
// [Archive writer] in worker/zip_writer.h), on a record of 4 GiB: torch-free.
// With CONCORD_TEST_ARCHIVE_DIR set the archive is left there (sparse: the
// big record is zeros, a hole) for tests/integration/test_checkpoint.py's
// "archive" case, which reads it with Python's zipfile.
#include "worker/zip_writer.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "worker/crc32.h"

namespace concord {
namespace {

uint64_t Le(const std::string& b, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) {
    v |= uint64_t{static_cast<unsigned char>(b[at + i])} << (8 * i);
  }
  return v;
}

// The archive's bytes, the big record left out (a hole of its size).
struct Sparse {
  std::vector<std::pair<uint64_t, std::string>> pieces;  // offset, bytes
  uint64_t size = 0;
  uint64_t hole_at = 0, hole = 0;
};

TEST(ZipWriterTest, ARecordOf4GiBAndOneAfterItGetZip64Headers) {
  const size_t big = (size_t{1} << 32) + 1;
  void* zeros = ::mmap(nullptr, big, PROT_READ,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  ASSERT_NE(zeros, MAP_FAILED);
  Sparse out;
  ZipWriter zip("archive", [&](const void* data, size_t n, bool lasting) {
    if (data == zeros) {
      EXPECT_TRUE(lasting);
      out.hole_at = out.size;
      out.hole = n;
    } else {
      out.pieces.emplace_back(out.size,
                              std::string(static_cast<const char*>(data), n));
    }
    out.size += n;
    return true;
  });
  const std::string small = "after the big one";
  ASSERT_TRUE(zip.Add("data/0", zeros, big, /*lasting=*/true).ok());
  ASSERT_TRUE(zip.Add("small", small.data(), small.size(), false).ok());
  ASSERT_TRUE(zip.Finish().ok());
  ::munmap(zeros, big);
  EXPECT_EQ(zip.size(), out.size);
  EXPECT_EQ(out.hole, big);
  EXPECT_EQ(out.hole_at % ZipWriter::kPageAlign, 0u);

  // The big record's local header: sizes all ones, the ZIP64 field holds
  // them.
  const std::string& local = out.pieces.front().second;
  ASSERT_EQ(Le(local, 0, 4), 0x04034b50u);
  EXPECT_EQ(Le(local, 18, 4), 0xFFFFFFFFu);
  EXPECT_EQ(Le(local, 22, 4), 0xFFFFFFFFu);
  const size_t extra = 30 + Le(local, 26, 2);
  EXPECT_EQ(Le(local, extra, 2), 1u);
  EXPECT_EQ(Le(local, extra + 4, 8), big);
  EXPECT_EQ(Le(local, extra + 12, 8), big);

  // The end: the ZIP64 record and locator, then the end record with its
  // central directory offset all ones (the directory starts past 4 GiB).
  const std::string& end = out.pieces.back().second;
  ASSERT_EQ(end.size(), 56u + 20u + 22u);
  EXPECT_EQ(Le(end, 0, 4), 0x06064b50u);
  EXPECT_EQ(Le(end, 24, 8), 2u);  // records
  const uint64_t cd_offset = Le(end, 48, 8);
  EXPECT_GT(cd_offset, big);
  EXPECT_EQ(Le(end, 56, 4), 0x07064b50u);
  EXPECT_EQ(Le(end, 76, 4), 0x06054b50u);
  EXPECT_EQ(Le(end, 76 + 16, 4), 0xFFFFFFFFu);
  EXPECT_EQ(Le(end, 76 + 10, 2), 2u);  // records: they fit in 16 bits

  // The central directory: the big one with its sizes in ZIP64, the small
  // one with its offset (past 4 GiB) there.
  const std::string& cd = out.pieces[out.pieces.size() - 2].second;
  ASSERT_EQ(out.pieces[out.pieces.size() - 2].first, cd_offset);
  EXPECT_EQ(Le(cd, 20, 4), 0xFFFFFFFFu);
  EXPECT_EQ(Le(cd, 42, 4), 0u);  // the big one starts the archive
  const size_t first = 46 + Le(cd, 28, 2) + Le(cd, 30, 2);
  EXPECT_EQ(Le(cd, 46 + Le(cd, 28, 2) + 4, 8), big);
  EXPECT_EQ(Le(cd, first + 20, 4), small.size());
  EXPECT_EQ(Le(cd, first + 42, 4), 0xFFFFFFFFu);
  const size_t small_extra = first + 46 + Le(cd, first + 28, 2);
  EXPECT_EQ(Le(cd, small_extra, 2), 1u);
  EXPECT_EQ(Le(cd, small_extra + 2, 2), 8u);
  EXPECT_GT(Le(cd, small_extra + 4, 8), big);

  if (const char* dir = std::getenv("CONCORD_TEST_ARCHIVE_DIR")) {
    const std::string path = std::string(dir) + "/zip64-4gib.zip";
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ASSERT_GE(fd, 0) << path;
    for (const auto& [at, bytes] : out.pieces) {
      ASSERT_EQ(
          ::pwrite(fd, bytes.data(), bytes.size(), static_cast<off_t>(at)),
          static_cast<ssize_t>(bytes.size()));
    }
    ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(out.size)), 0);
    ::close(fd);
  }
}

// A hole (see Note [Shards written where they are] in
// worker/checkpoint/disk.h), once its bytes are written at the offset
// AddHole gave, makes the very archive Add makes, CRC-32 and all; until
// then the sink had a hole for it (null data, zeros once read back).
TEST(ZipWriterTest, AHoleFilledAtItsOffsetIsTheArchiveAddWrites) {
  std::string big((size_t{100} << 10) + 3, '\0');  // page-aligned (>= 64 KiB)
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 7);
  const std::string small = "a small record";
  const std::string tail = "after them";
  auto write = [&](bool holes, std::vector<uint64_t>* at) {
    std::string out;
    ZipWriter zip("archive", [&](const void* data, size_t n, bool) {
      if (data == nullptr) {
        EXPECT_TRUE(holes);
        out.append(n, '\0');  // a hole reads back as zeros
      } else {
        out.append(static_cast<const char*>(data), n);
      }
      return true;
    });
    for (const std::string* r : std::vector<const std::string*>{&big, &small}) {
      const std::string name = r == &big ? "data/0" : "data/1";
      if (holes) {
        auto offset =
            zip.AddHole(name, r->size(), Crc32(0, r->data(), r->size()));
        EXPECT_TRUE(offset.ok());
        at->push_back(*offset);
      } else {
        EXPECT_TRUE(zip.Add(name, r->data(), r->size(), false).ok());
      }
    }
    EXPECT_TRUE(zip.Add("tail", tail.data(), tail.size(), false).ok());
    EXPECT_TRUE(zip.Finish().ok());
    EXPECT_EQ(zip.size(), out.size());
    if (!holes) {
      EXPECT_EQ(zip.crc32(), Crc32(0, out.data(), out.size()));
    }
    return std::make_pair(out, zip.crc32());
  };
  std::vector<uint64_t> at;
  const auto [whole, whole_crc] = write(false, nullptr);
  auto [holed, holed_crc] = write(true, &at);
  ASSERT_EQ(at.size(), 2u);
  EXPECT_EQ(at[0] % ZipWriter::kPageAlign, 0u);
  EXPECT_EQ(at[1] % ZipWriter::kAlign, 0u);
  EXPECT_EQ(holed.substr(at[0], big.size()), std::string(big.size(), '\0'));
  EXPECT_EQ(holed.substr(at[1], small.size()), std::string(small.size(), '\0'));
  holed.replace(at[0], big.size(), big);
  holed.replace(at[1], small.size(), small);
  EXPECT_EQ(holed, whole);
  // The archive's CRC counts the bytes that fill the holes.
  EXPECT_EQ(holed_crc, whole_crc);
  EXPECT_EQ(holed_crc, Crc32(0, whole.data(), whole.size()));
}

// A sink that fails stops the writer: every later call says so.
TEST(ZipWriterTest, AFailedSinkFailsEveryCallAfter) {
  int calls = 0;
  ZipWriter zip("archive",
                [&](const void*, size_t, bool) { return ++calls < 2; });
  const std::string bytes = "abc";
  EXPECT_FALSE(zip.Add("a", bytes.data(), bytes.size(), false).ok());
  EXPECT_FALSE(zip.Add("b", bytes.data(), bytes.size(), false).ok());
  EXPECT_FALSE(zip.Finish().ok());
  EXPECT_EQ(calls, 2);
}

}  // namespace
}  // namespace concord
