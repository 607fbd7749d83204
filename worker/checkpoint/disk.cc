#include "worker/checkpoint/disk.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/errno_status.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "worker/checkpoint/file_writer.h"
#include "worker/checkpoint/writer_lock.h"
#include "worker/crc32.h"
#include "worker/zip_writer.h"

namespace concord::checkpoint {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr char kFormat[] = "concord-checkpoint";
constexpr int kFormatVersion = 1;
// The manifest's own check: the CRC-32 of its compact JSON without this key
// (keys sorted, as nlohmann::json keeps them), so that a flipped digit in
// the epoch or the sample position is caught as a flipped byte of a data
// file is. A manifest written before it has none and is taken as it is.
constexpr char kManifestCrc[] = "manifest_crc32";

uint32_t ManifestCrc(json manifest) {
  manifest.erase(kManifestCrc);
  const std::string text = manifest.dump();
  return Crc32(0, text.data(), text.size());
}
constexpr char kStateFile[] = "state.pt";
constexpr char kManifest[] = "manifest.json";

absl::Status SyncDir(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus("cannot open directory", path);
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return ErrnoStatus("cannot sync directory", path);
  return absl::OkStatus();
}

// A file written through `fill(sink)` and fsynced; its size and CRC-32.
struct Written {
  uint64_t size = 0;
  uint32_t crc = 0;
};

// See Note [Direct writes] in worker/checkpoint/file_writer.h: `fill(sink,
// &crc)` writes the file's bytes and sets their CRC-32.
template <typename Fill>
absl::StatusOr<Written> WriteFile(const std::string& path, Fill fill,
                                  std::shared_ptr<WriteBuffers> buffers) {
  CONCORD_ASSIGN_OR_RETURN(std::unique_ptr<FileWriter> file,
                           FileWriter::Create(path, std::move(buffers)));
  Written w;
  const ZipWriter::Sink sink = [&](const void* data, size_t n, bool lasting) {
    if (data == nullptr) return file->Skip(n);
    return lasting ? file->AppendLasting(data, n) : file->Append(data, n);
  };
  const absl::Status filled = fill(sink, &w.crc);
  // A failed write says why first; a fill that failed on its own after.
  CONCORD_RETURN_IF_ERROR(file->Finish());
  if (!filled.ok()) {
    return absl::Status(filled.code(),
                        absl::StrCat(path, ": ", filled.message()));
  }
  w.size = file->size();
  return w;
}

// `value`'s CPU tensors outlive the file's Finish and do not change until
// then (the snapshot region's memory, which the persister holds; or a
// program's tensors during its synchronous save_checkpoint): the archive's
// big records may go to the disk from where they lie.
absl::StatusOr<Written> WriteArchiveFile(const std::string& path,
                                         const c10::IValue& value,
                                         std::shared_ptr<WriteBuffers> buffers,
                                         ArchiveHoles* holes = nullptr) {
  return WriteFile(
      path,
      [&](const ZipWriter::Sink& sink, uint32_t* crc) {
        return WriteArchive(value, sink, crc, {}, holes);
      },
      std::move(buffers));
}

absl::StatusOr<Written> WriteTextFile(const std::string& path,
                                      const std::string& text) {
  return WriteFile(
      path,
      [&](const ZipWriter::Sink& sink, uint32_t* crc) {
        *crc = Crc32(0, text.data(), text.size());
        return sink(text.data(), text.size(), /*lasting=*/false)
                   ? absl::OkStatus()
                   : absl::UnavailableError("the write failed");
      },
      std::make_shared<WriteBuffers>(text.size(), 0));
}

c10::IValue TensorDict(const NamedTensors& tensors) {
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  for (const auto& [k, t] : tensors) d.insert(k, t);
  return d;
}

// A module's or optimizer's file: its name, when it makes a plain file name
// (letters, digits, '_', '-', '.'; not state or manifest).
absl::StatusOr<std::string> FileOf(const std::string& name,
                                   std::set<std::string>& taken) {
  const bool plain = !name.empty() && name[0] != '.' &&
                     std::all_of(name.begin(), name.end(), [](char c) {
                       return std::isalnum(static_cast<unsigned char>(c)) ||
                              c == '_' || c == '-' || c == '.';
                     });
  const std::string file = absl::StrCat(name, ".pt");
  if (!plain || file == kStateFile || !taken.insert(file).second) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", name,
        "' cannot name a checkpoint file (letters, digits, '_', '-', '.'; "
        "each module and optimizer a name of its own, not 'state')"));
  }
  return file;
}

// A job id that names one directory under DIR (the coordinator's ids are;
// a program alone takes CONCORD_JOB_ID as it is).
absl::Status CheckJob(const std::string& job) {
  if (job.empty() || job[0] == '.' || job.find('/') != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("job id '", job, "' cannot name a checkpoint directory"));
  }
  return absl::OkStatus();
}

std::string JobDir(const std::string& dir, const std::string& job) {
  return (fs::path(dir) / job).string();
}

// Removes `path` and what it holds; false (with errno's message in `why`)
// when it could not.
bool RemoveAll(const std::string& path, std::string* why) {
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec && why != nullptr) *why = ec.message();
  return !ec;
}

// The step of a name "<prefix><N>[-...]", or -1.
int64_t StepOf(const std::string& name, const std::string& prefix) {
  if (!absl::StartsWith(name, prefix)) return -1;
  std::string rest = name.substr(prefix.size());
  if (auto dash = rest.find('-'); dash != std::string::npos) rest.resize(dash);
  int64_t step = -1;
  if (!absl::SimpleAtoi(rest, &step) || step < 0) return -1;
  return step;
}

// A file a manifest names: there, of the size it says. INVALID_ARGUMENT when
// it cannot be seen, DATA_LOSS for another size, each naming the file.
absl::Status CheckSize(const std::string& path, uint64_t size) {
  std::error_code ec;
  const uintmax_t actual = fs::file_size(path, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat(fs::path(path).filename().string(), ": ", ec.message()));
  }
  if (actual != size) {
    return absl::DataLossError(
        absl::StrCat(fs::path(path).filename().string(), ": ", actual,
                     " bytes, the manifest says ", size));
  }
  return absl::OkStatus();
}

// A step-N directory: its manifest parsed and its files there at their
// sizes (what pruning counts; their CRC-32s are checked as they load), or
// why not.
struct Scanned {
  CheckpointInfo info;
  absl::Status status;
  json manifest;
};

Scanned Scan(const std::string& path, const std::string& job) {
  Scanned s;
  s.info.path = path;
  std::ifstream in(fs::path(path) / kManifest);
  if (!in) {
    s.status = absl::InvalidArgumentError("no manifest.json");
    return s;
  }
  s.manifest = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (s.manifest.is_discarded() || !s.manifest.is_object()) {
    s.status = absl::InvalidArgumentError("manifest.json is not JSON");
    return s;
  }
  try {
    const json& m = s.manifest;
    if (m.at("format") != kFormat || m.at("version") != kFormatVersion) {
      s.status = absl::InvalidArgumentError(absl::StrCat(
          "manifest.json: not a ", kFormat, " of version ", kFormatVersion));
      return s;
    }
    if (m.contains(kManifestCrc) &&
        m.at(kManifestCrc).get<uint32_t>() != ManifestCrc(m)) {
      s.status = absl::InvalidArgumentError(
          "manifest.json: its fields do not match their CRC-32 (damaged)");
      return s;
    }
    if (m.at("job") != job) {
      s.status = absl::InvalidArgumentError(absl::StrCat(
          "manifest.json: of job ", m.at("job").dump(), ", not ", job));
      return s;
    }
    s.info.step = m.at("step").get<int64_t>();
    s.info.epoch = m.at("epoch").get<int64_t>();
    s.info.position = m.at("samples").get<int64_t>();
    s.info.world_size = m.at("world_size").get<int64_t>();
    s.info.generation = m.at("generation").get<int64_t>();
    s.info.run = m.value("run", int64_t{0});
    for (const auto& [file, f] : m.at("files").items()) {
      const uint64_t size = f.at("size").get<uint64_t>();
      s.info.bytes += size;
      if (s.status.ok()) {
        s.status = CheckSize((fs::path(path) / file).string(), size);
      }
    }
  } catch (const json::exception& e) {
    s.status =
        absl::InvalidArgumentError(absl::StrCat("manifest.json: ", e.what()));
  }
  return s;
}

// Whether `a` is newer than `b` (see Note [Runs] in coordinator/core/core.h).
bool NewerInfo(const CheckpointInfo& a, const CheckpointInfo& b) {
  return Newer(Counters{a.step, 0, 0, 0, 0, a.run},
               Counters{b.step, 0, 0, 0, 0, b.run});
}

// Every step-N directory, newest first (by run, then step; one whose
// manifest does not parse by its name's step, as of run 0), scanned.
std::vector<Scanned> ScanAll(const std::string& dir, const std::string& job) {
  if (!CheckJob(job).ok()) return {};
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(JobDir(dir, job), ec)) {
    const std::string name = entry.path().filename().string();
    const int64_t step = StepOf(name, "step-");
    if (step >= 0 && name == absl::StrCat("step-", step)) {
      found.emplace_back(step, entry.path().string());
    }
  }
  std::vector<Scanned> out;
  for (const auto& [step, path] : found) {
    Scanned s = Scan(path, job);
    if (s.status.ok() && s.info.step != step) {
      s.status = absl::InvalidArgumentError(absl::StrCat(
          "manifest.json says step ", s.info.step, " in step-", step));
    }
    if (!s.status.ok()) {
      s.info.step = step;
      s.info.run = 0;
    }
    out.push_back(std::move(s));
  }
  std::sort(out.begin(), out.end(), [](const Scanned& a, const Scanned& b) {
    return NewerInfo(a.info, b.info);
  });
  return out;
}

absl::StatusOr<std::vector<char>> ReadChecked(const std::string& path,
                                              const json& entry) {
  const uint64_t size = entry.at("size").get<uint64_t>();
  const uint32_t crc = entry.at("crc32").get<uint32_t>();
  CONCORD_RETURN_IF_ERROR(CheckSize(path, size));
  std::vector<char> bytes(size);
  std::ifstream in(path, std::ios::binary);
  if (!in.read(bytes.data(), static_cast<std::streamsize>(size))) {
    return absl::InvalidArgumentError(
        absl::StrCat(fs::path(path).filename().string(), ": cannot read"));
  }
  if (Crc32(0, bytes.data(), bytes.size()) != crc) {
    return absl::DataLossError(
        absl::StrCat(fs::path(path).filename().string(),
                     ": its CRC-32 is not the manifest's"));
  }
  return bytes;
}

absl::StatusOr<NamedTensors> TensorsOf(const c10::IValue& v,
                                       const std::string& file) {
  if (!v.isGenericDict()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": not a dict"));
  }
  NamedTensors out;
  for (const auto& e : v.toGenericDict()) {
    if (!e.key().isString() || !e.value().isTensor()) {
      return absl::InvalidArgumentError(
          absl::StrCat(file, ": not a dict of tensors"));
    }
    out.emplace_back(e.key().toStringRef(), e.value().toTensor());
  }
  return out;
}

// A checkpoint's files written into a staging directory next to where it
// will be, with the manifest that lists them (each file's CRC-32 from the
// archive writer's pieces: see Note [Archive writer] in worker/zip_writer.h).
class Staging {
 public:
  Staging(std::string path, json manifest,
          std::shared_ptr<WriteBuffers> buffers)
      : path_(std::move(path)),
        manifest_(std::move(manifest)),
        buffers_(std::move(buffers)) {}

  // Makes the directory (an earlier one of this step and process removed).
  // The archives' blocks come from `buffers` (see Note [Write queue]).
  static absl::StatusOr<Staging> Make(const std::string& job_dir,
                                      const Content& content,
                                      const std::string& job,
                                      std::shared_ptr<WriteBuffers> buffers) {
    std::error_code ec;
    // The folders this write makes (the job's, and the checkpoint folder and
    // those above it that are not there yet), outermost first.
    std::vector<fs::path> made;
    for (fs::path p = job_dir; !p.empty() && !fs::exists(p, ec);
         p = p.parent_path()) {
      made.insert(made.begin(), p);
      if (p == p.parent_path()) break;
    }
    fs::create_directories(job_dir, ec);
    if (ec) {
      return absl::UnavailableError(
          absl::StrCat("cannot make ", job_dir, ": ", ec.message()));
    }
    // A job's first checkpoint: each new folder's entry in its parent is
    // made durable too, as every later rename's is.
    for (const fs::path& p : made) {
      CONCORD_RETURN_IF_ERROR(SyncDir(p.parent_path().string()));
    }
    // See Note [One writer per folder] in worker/checkpoint/writer_lock.h.
    CONCORD_RETURN_IF_ERROR(HoldWriterLock(job_dir, content.counters.run));
    const int64_t step = content.counters.step;
    std::string path = (fs::path(job_dir) /
                        absl::StrCat(".staging-step-", step, "-", ::getpid()))
                           .string();
    RemoveAll(path, nullptr);
    if (::mkdir(path.c_str(), 0755) != 0)
      return ErrnoStatus("cannot make", path);
    return Staging(std::move(path), ManifestOf(content, job),
                   std::move(buffers));
  }

  const std::string& path() const { return path_; }
  uint64_t bytes() const { return bytes_; }
  // The holes WriteContent left (see Note [Shards written where they are]).
  const std::vector<FileHole>& holes() const { return holes_; }

  // One file per module and per optimizer of a known type, then the rest
  // (counters, extra tensors, the optimizers' native states) in state.pt.
  absl::Status WriteContent(const Content& content) {
    std::set<std::string> taken;
    NamedTensors state = content.extra;
    for (const auto& [name, tensors] : content.modules) {
      CONCORD_ASSIGN_OR_RETURN(const std::string file, FileOf(name, taken));
      CONCORD_RETURN_IF_ERROR(
          Add(file, TensorDict(tensors), {{"kind", "module"}, {"name", name}}));
      manifest_["modules"].push_back(name);
    }
    for (const OptimizerContent& o : content.optimizers) {
      manifest_["optimizers"].push_back({{"name", o.name}, {"type", o.type}});
      if (o.type.empty()) {
        state.emplace_back(absl::StrCat("optimizer/", o.name), o.native);
        continue;
      }
      CONCORD_ASSIGN_OR_RETURN(const std::string file, FileOf(o.name, taken));
      // See Note [Shards written where they are]: a hole is an empty CPU
      // tensor in the archive (never touched, so never in memory), its
      // record's data left unwritten (a sparse hole) under the CRC of what
      // will fill it.
      OptimizerContent laid = o;
      ArchiveHoles holes;
      std::vector<FileHole> found;
      std::vector<const void*> keys;
      for (auto& [index, tensors] : laid.state) {
        for (auto& [key, t] : tensors) {
          if (!t.is_meta()) continue;
          const auto crc = o.hole_crc.find({index, key});
          if (crc == o.hole_crc.end()) {
            return absl::InternalError(absl::StrCat(
                "optimizer '", o.name, "': a hole (parameter ", index, ", '",
                key, "') with no CRC to write it with"));
          }
          t = at::empty(t.sizes(), t.options().device(at::kCPU));
          keys.push_back(t.storage().unsafeGetStorageImpl());
          holes.crc[keys.back()] = crc->second;
          found.push_back({o.name, index, key,
                           (fs::path(path_) / file).string(), 0,
                           t.storage().nbytes()});
        }
      }
      CONCORD_RETURN_IF_ERROR(
          Add(file, OptimizerToIValue(laid),
              {{"kind", "optimizer"}, {"name", o.name}, {"type", o.type}},
              found.empty() ? nullptr : &holes));
      for (size_t k = 0; k < found.size(); ++k) {
        const auto at = holes.offset.find(keys[k]);
        if (at == holes.offset.end()) {
          return absl::InternalError(absl::StrCat(
              "optimizer '", o.name, "': the hole of parameter ",
              found[k].index, ", '", found[k].key, "' is not in its file"));
        }
        found[k].offset = at->second;
      }
      holes_.insert(holes_.end(), found.begin(), found.end());
    }
    return Add(kStateFile, TensorDict(state), {{"kind", "state"}});
  }

  // The manifest last, then the directory's entries made durable.
  absl::Status Seal() {
    manifest_[kManifestCrc] = ManifestCrc(manifest_);
    CONCORD_RETURN_IF_ERROR(
        WriteTextFile((fs::path(path_) / kManifest).string(),
                      manifest_.dump(2) + "\n")
            .status());
    return SyncDir(path_);
  }

 private:
  static json ManifestOf(const Content& content, const std::string& job) {
    return {{"format", kFormat},
            {"version", kFormatVersion},
            {"job", job},
            {"step", content.counters.step},
            {"epoch", content.counters.epoch},
            {"samples", content.counters.position},
            {"world_size", content.counters.world_size},
            {"generation", content.counters.generation},
            {"run", content.counters.run},
            {"created_unix_ms",
             std::chrono::duration_cast<std::chrono::milliseconds>(
                 std::chrono::system_clock::now().time_since_epoch())
                 .count()},
            {"modules", json::array()},
            {"optimizers", json::array()},
            {"files", json::object()}};
  }

  absl::Status Add(const std::string& file, const c10::IValue& value,
                   json description, ArchiveHoles* holes = nullptr) {
    CONCORD_ASSIGN_OR_RETURN(const Written w,
                             WriteArchiveFile((fs::path(path_) / file).string(),
                                              value, buffers_, holes));
    description["size"] = w.size;
    description["crc32"] = w.crc;
    manifest_["files"][file] = std::move(description);
    bytes_ += w.size;
    return absl::OkStatus();
  }

  std::string path_;
  json manifest_;
  std::shared_ptr<WriteBuffers> buffers_;
  uint64_t bytes_ = 0;
  std::vector<FileHole> holes_;
};

// Renames the sealed staging directory to step-N (an older step-N moved
// aside first, removed once the new one is in place).
absl::Status Publish(const std::string& staging, const std::string& job_dir,
                     const std::string& final_dir, int64_t step) {
  std::string trash;
  if (fs::exists(final_dir)) {
    // An older run's (passed over at load, or this very step again).
    trash = (fs::path(job_dir) /
             absl::StrCat(".trash-step-", step, "-", ::getpid()))
                .string();
    RemoveAll(trash, nullptr);
    if (::rename(final_dir.c_str(), trash.c_str()) != 0) {
      return ErrnoStatus("cannot move aside", final_dir);
    }
  }
  if (::rename(staging.c_str(), final_dir.c_str()) != 0) {
    return ErrnoStatus("cannot rename into place", final_dir);
  }
  CONCORD_RETURN_IF_ERROR(SyncDir(job_dir));
  if (!trash.empty()) RemoveAll(trash, nullptr);
  return absl::OkStatus();
}

// The temporary file `latest` is written to before its rename.
std::string LatestTmp(const std::string& job_dir) {
  return (fs::path(job_dir) / absl::StrCat(".latest-", ::getpid())).string();
}

// `latest` says step-N, replaced by rename; never moved back to an older
// checkpoint (by run, then step) while the one it names is complete there
// (another writer's newer one).
absl::Status ReplaceLatest(const std::string& job_dir, const std::string& job,
                           const CheckpointInfo& written, WriteFault fault) {
  const std::string latest = (fs::path(job_dir) / "latest").string();
  const int64_t step = written.step;
  {
    std::ifstream in(latest);
    std::string named;
    if (in && std::getline(in, named) && StepOf(named, "step-") >= 0 &&
        named != absl::StrCat("step-", step)) {
      const Scanned there = Scan((fs::path(job_dir) / named).string(), job);
      if (there.status.ok() && NewerInfo(there.info, written)) {
        return absl::OkStatus();
      }
    }
  }
  const std::string latest_tmp = LatestTmp(job_dir);
  std::remove(latest_tmp.c_str());
  const std::string text = absl::StrCat("step-", step, "\n");
  if (fault == WriteFault::kDuringLatest) {
    (void)WriteTextFile(latest_tmp, text.substr(0, text.size() / 2));
    return absl::AbortedError("test fault while replacing latest");
  }
  CONCORD_RETURN_IF_ERROR(WriteTextFile(latest_tmp, text).status());
  if (::rename(latest_tmp.c_str(), latest.c_str()) != 0) {
    const absl::Status s = ErrnoStatus("cannot rename into place", latest);
    std::remove(latest_tmp.c_str());
    return s;
  }
  return SyncDir(job_dir);
}

// After step `step` is in place: the complete ones beyond `keep` go, and
// what crashed writers left (staging, trash, `latest` temporaries).
void Prune(const std::string& dir, const std::string& job,
           const CheckpointInfo& written, int keep) {
  const int64_t step = written.step;
  std::vector<Scanned> all = ScanAll(dir, job);
  int kept = 0;
  int64_t oldest_kept = step;
  for (const Scanned& s : all) {
    if (!s.status.ok()) continue;
    if (NewerInfo(s.info, written)) continue;  // another writer's newer one
    if (++kept > keep) {
      RemoveAll(s.info.path, nullptr);
    } else {
      oldest_kept = s.info.step;
    }
  }
  // A damaged one is never loaded; it goes once `keep` complete ones newer
  // than it exist (until then it is left for a person to look at).
  if (kept >= keep) {
    for (const Scanned& s : all) {
      const int64_t at =
          StepOf(fs::path(s.info.path).filename().string(), "step-");
      if (!s.status.ok() && at >= 0 && at < oldest_kept) {
        RemoveAll(s.info.path, nullptr);
      }
    }
  }
  const std::string job_dir = JobDir(dir, job);
  const std::string own_latest_tmp = LatestTmp(job_dir);
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(job_dir, ec)) {
    const std::string name = entry.path().filename().string();
    const int64_t staged =
        std::max(StepOf(name, ".staging-step-"), StepOf(name, ".trash-step-"));
    if (staged >= 0 && staged < step) RemoveAll(entry.path().string(), nullptr);
    if (absl::StartsWith(name, ".latest-") && name != ".latest-" &&
        entry.path().string() != own_latest_tmp) {
      std::remove(entry.path().c_str());
    }
  }
}

}  // namespace

absl::StatusOr<WriteStats> WriteCheckpoint(const Content& content,
                                           const std::string& dir,
                                           const std::string& job,
                                           const WriteOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  CONCORD_RETURN_IF_ERROR(CheckJob(job));
  const int64_t step = content.counters.step;
  const std::string job_dir = JobDir(dir, job);
  CONCORD_ASSIGN_OR_RETURN(
      Staging staging, Staging::Make(job_dir, content, job,
                                     options.buffers != nullptr
                                         ? options.buffers
                                         : std::make_shared<WriteBuffers>()));
  // A failure leaves nothing behind; a test fault leaves what a crash would.
  auto failed = [&](absl::Status s) {
    if (s.code() != absl::StatusCode::kAborted) {
      RemoveAll(staging.path(), nullptr);
    }
    return s;
  };
  if (absl::Status s = staging.WriteContent(content); !s.ok()) {
    return failed(s);
  }
  if (!staging.holes().empty()) {
    absl::Status s = options.fill_holes
                         ? options.fill_holes(staging.holes())
                         : absl::InternalError(
                               "a checkpoint with holes and nobody to "
                               "fill them");
    if (!s.ok()) return failed(s);
  }
  if (options.fault == WriteFault::kBeforeManifest) {
    return absl::AbortedError("test fault before the manifest");
  }
  if (absl::Status s = staging.Seal(); !s.ok()) return failed(s);
  if (options.fault == WriteFault::kBeforeRename) {
    return absl::AbortedError("test fault before the rename");
  }
  const std::string final_dir =
      (fs::path(job_dir) / absl::StrCat("step-", step)).string();
  if (absl::Status s = Publish(staging.path(), job_dir, final_dir, step);
      !s.ok()) {
    return failed(s);
  }
  // The checkpoint is complete and loads from here on (the loader takes
  // the newest complete step-N, `latest` is for people): a failure to
  // point `latest` at it is a warning, not a failed checkpoint.
  WriteStats stats;
  CheckpointInfo written;
  written.step = step;
  written.run = content.counters.run;
  if (absl::Status s = ReplaceLatest(job_dir, job, written, options.fault);
      !s.ok()) {
    if (s.code() == absl::StatusCode::kAborted) return s;  // a test fault
    stats.warning = absl::StrCat("'latest' not updated: ", s.message());
  }
  stats.path = final_dir;
  stats.bytes = staging.bytes();
  stats.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  // Only now, and not in the write's time.
  Prune(dir, job, written, options.keep);
  return stats;
}

std::vector<CheckpointInfo> ListCheckpoints(const std::string& dir,
                                            const std::string& job) {
  std::vector<CheckpointInfo> out;
  for (const Scanned& s : ScanAll(dir, job)) {
    if (s.status.ok()) out.push_back(s.info);
  }
  return out;
}

absl::StatusOr<Content> LoadCheckpoint(const std::string& path,
                                       const std::string& job) {
  Scanned s = Scan(path, job);
  CONCORD_RETURN_IF_ERROR(s.status);
  Content c;
  c.counters.step = s.info.step;
  c.counters.epoch = s.info.epoch;
  c.counters.position = s.info.position;
  c.counters.world_size = s.info.world_size;
  c.counters.generation = s.info.generation;
  c.counters.run = s.info.run;
  try {
    const json& files = s.manifest.at("files");
    auto read = [&](const std::string& file) -> absl::StatusOr<c10::IValue> {
      if (!files.contains(file)) {
        return absl::InvalidArgumentError(
            absl::StrCat("manifest.json lists no ", file));
      }
      CONCORD_ASSIGN_OR_RETURN(
          std::vector<char> bytes,
          ReadChecked((fs::path(path) / file).string(), files.at(file)));
      auto value = ReadArchive(bytes);
      if (!value.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(file, ": ", value.status().message()));
      }
      return value;
    };
    for (const json& name : s.manifest.at("modules")) {
      const std::string file = absl::StrCat(name.get<std::string>(), ".pt");
      CONCORD_ASSIGN_OR_RETURN(c10::IValue v, read(file));
      CONCORD_ASSIGN_OR_RETURN(NamedTensors t, TensorsOf(v, file));
      c.modules.emplace_back(name.get<std::string>(), std::move(t));
    }
    CONCORD_ASSIGN_OR_RETURN(c10::IValue state_value, read(kStateFile));
    CONCORD_ASSIGN_OR_RETURN(NamedTensors state,
                             TensorsOf(state_value, kStateFile));
    std::map<std::string, at::Tensor> natives;
    for (auto& [key, t] : state) {
      if (absl::StartsWith(key, "optimizer/")) {
        natives[key.substr(std::strlen("optimizer/"))] = t;
      } else {
        c.extra.emplace_back(key, t);
      }
    }
    for (const json& o : s.manifest.at("optimizers")) {
      const std::string name = o.at("name").get<std::string>();
      const std::string type = o.at("type").get<std::string>();
      if (type.empty()) {
        OptimizerContent oc;
        oc.name = name;
        if (!natives.count(name)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "state.pt has no LibTorch archive of optimizer '", name, "'"));
        }
        oc.native = natives[name];
        c.optimizers.push_back(std::move(oc));
        continue;
      }
      const std::string file = absl::StrCat(name, ".pt");
      CONCORD_ASSIGN_OR_RETURN(c10::IValue v, read(file));
      auto oc = OptimizerFromIValue(name, type, v);
      if (!oc.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(file, ": ", oc.status().message()));
      }
      c.optimizers.push_back(*std::move(oc));
    }
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("manifest.json: ", e.what()));
  }
  return c;
}

absl::StatusOr<Loaded> LoadNewest(const std::string& dir,
                                  const std::string& job, int64_t only_run) {
  for (Scanned& s : ScanAll(dir, job)) {
    if (only_run != 0 && (!s.status.ok() || s.info.run != only_run)) continue;
    absl::StatusOr<Content> content =
        s.status.ok() ? LoadCheckpoint(s.info.path, job) : s.status;
    if (content.ok()) return Loaded{s.info, *std::move(content)};
    Log()->warn("checkpoint {} passed over: {}", s.info.path,
                std::string(content.status().message()));
  }
  return absl::NotFoundError(absl::StrCat(
      "no complete checkpoint of job ", job,
      only_run != 0 ? absl::StrCat(" of run ", only_run) : std::string(),
      " in ", dir));
}

}  // namespace concord::checkpoint
