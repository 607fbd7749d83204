// torch.save's archive as Concord writes it (see Note [Archive writer] in
// worker/zip_writer.h), read back by LibTorch's reader (miniz, which checks
// each record's CRC-32) in the plain form and in the ZIP64 one: the same
// values, big records at 4 KiB offsets, the archive's CRC-32 zlib's over its
// bytes, and CPU storages handed over as lasting. With
// CONCORD_TEST_ARCHIVE_DIR set the archives are left there for
// tests/integration/test_checkpoint.py's "archive" case (Python's zipfile
// and torch.load with weights_only=True).
#include <caffe2/serialize/inline_container.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <zlib.h>

#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "worker/state_dict_file.h"
#include "worker/zip_writer.h"

namespace concord {
namespace {

// What the Python case checks against: the same values, made there.
c10::impl::GenericDict Sample() {
  c10::impl::GenericDict d(c10::StringType::get(), c10::TensorType::get());
  d.insert("big", torch::arange(20000, torch::kFloat32) / 7);  // 80 KB
  d.insert("small", torch::tensor({1.5, -2.0, 3.25}, torch::kFloat32));
  d.insert("ints", torch::arange(7, torch::kInt64));
  return d;
}

TEST(ArchiveWriterTest, LibTorchReadsBothFormsAndBigRecordsLieAtPages) {
  for (bool zip64 : {false, true}) {
    SCOPED_TRACE(zip64 ? "zip64" : "plain");
    const c10::impl::GenericDict sample = Sample();
    std::string bytes;
    std::set<const void*> lasting;
    uint32_t crc = 0;
    ZipWriter::Options options;
    options.zip64 = zip64;
    ASSERT_TRUE(WriteArchive(
                    c10::IValue(sample),
                    [&](const void* data, size_t n, bool last) {
                      if (last) lasting.insert(data);
                      bytes.append(static_cast<const char*>(data), n);
                      return true;
                    },
                    &crc, options)
                    .ok());
    EXPECT_EQ(crc, crc32_z(0, reinterpret_cast<const Bytef*>(bytes.data()),
                           bytes.size()));
    std::set<const void*> storages;
    for (const auto& e : sample)
      storages.insert(e.value().toTensor().data_ptr());
    EXPECT_EQ(lasting, storages);

    absl::StatusOr<c10::IValue> back =
        ReadArchive(std::vector<char>(bytes.begin(), bytes.end()));
    ASSERT_TRUE(back.ok()) << back.status();
    const c10::impl::GenericDict read = back->toGenericDict();
    ASSERT_EQ(read.size(), sample.size());
    for (const auto& e : sample) {
      EXPECT_TRUE(
          torch::equal(read.at(e.key()).toTensor(), e.value().toTensor()))
          << e.key().toStringRef();
    }

    std::istringstream in(bytes);
    caffe2::serialize::PyTorchStreamReader reader(&in);
    EXPECT_TRUE(reader.hasRecord("data.pkl"));
    EXPECT_TRUE(reader.hasRecord("version"));
    EXPECT_EQ(reader.getRecordOffset("data/0") % ZipWriter::kPageAlign, 0u);
    EXPECT_EQ(reader.getRecordOffset("data/1") % ZipWriter::kAlign, 0u);
    EXPECT_EQ(reader.getRecordOffset("data/2") % ZipWriter::kAlign, 0u);

    if (const char* dir = std::getenv("CONCORD_TEST_ARCHIVE_DIR")) {
      std::ofstream(std::string(dir) + (zip64 ? "/zip64.pt" : "/plain.pt"),
                    std::ios::binary)
          << bytes;
    }
  }
}

}  // namespace
}  // namespace concord
