#include "concord/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "api/internal.h"
#include "common/environment.h"
#include "common/errno_status.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "common/write_all.h"
#include "worker/checkpoint/content.h"
#include "worker/checkpoint/disk.h"
#include "worker/comm/coalesced.h"
#include "worker/crc32.h"
#include "worker/error.h"
#include "worker/state_dict_file.h"

namespace concord {
namespace {

NamedTensors NamedStateOf(torch::nn::Module& module) {
  NamedTensors out;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    out.emplace_back(p.key(), p.value());
  }
  for (const auto& b : module.named_buffers(/*recurse=*/true)) {
    out.emplace_back(b.key(), b.value());
  }
  return out;
}

void CheckName(const std::string& name, std::set<std::string>& taken) {
  if (name.empty() || !taken.insert(name).second) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("CheckpointState::add('", name,
                             "'): a name of its own is needed"));
  }
}

// See Note [Shards written where they are] in worker/checkpoint/disk.h:
// rank 0 writes the files, the other ranks their shards into them.
constexpr int kWriter = 0;
// How much of a file's start tells a rank it sees the writer's file.
constexpr size_t kFingerprintBytes = 4096;

nlohmann::json StatusJson(const absl::Status& s) {
  return {{"code", static_cast<int>(s.code())},
          {"message", std::string(s.message())}};
}

absl::Status StatusOf(const nlohmann::json& j) {
  if (!j.is_object()) {
    return absl::InternalError("save_checkpoint: a malformed outcome");
  }
  return absl::Status(static_cast<absl::StatusCode>(j.value("code", 13)),
                      j.value("message", std::string()));
}

// (offset, bytes) of a file's holes.
using Ranges = std::vector<std::pair<uint64_t, uint64_t>>;

// A file's size and the CRC-32 of its first kFingerprintBytes, its `holes`
// taken as zeros (as the writer wrote them: ranks fill theirs meanwhile).
absl::StatusOr<std::pair<uint64_t, uint32_t>> Fingerprint(
    int fd, const std::string& path, const Ranges& holes) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return ErrnoStatus("cannot stat", path);
  std::string head(
      std::min<uint64_t>(static_cast<uint64_t>(st.st_size), kFingerprintBytes),
      '\0');
  size_t got = 0;
  while (got < head.size()) {
    const ssize_t n = ::pread(fd, head.data() + got, head.size() - got,
                              static_cast<off_t>(got));
    if (n <= 0) return ErrnoStatus("cannot read", path);
    got += static_cast<size_t>(n);
  }
  for (const auto& [offset, bytes] : holes) {
    if (offset >= head.size()) continue;
    const uint64_t n = std::min<uint64_t>(bytes, head.size() - offset);
    std::fill_n(head.begin() + static_cast<std::ptrdiff_t>(offset), n, '\0');
  }
  return std::make_pair(static_cast<uint64_t>(st.st_size),
                        Crc32(0, head.data(), head.size()));
}

// Whether the writer's `table` gives `path` the size and first bytes
// `print` says.
bool Matches(const nlohmann::json& table, const std::string& path,
             const std::pair<uint64_t, uint32_t>& print) {
  try {
    const nlohmann::json& want = table.at("files").at(path);
    return want.at(0).get<uint64_t>() == print.first &&
           want.at(1).get<uint32_t>() == print.second;
  } catch (const std::exception&) {
    return false;
  }
}

absl::Status WriteAt(int fd, const std::string& path, const void* data,
                     size_t n, uint64_t offset) {
  if (!WriteAllAt(fd, std::string_view(static_cast<const char*>(data), n),
                  offset)) {
    return ErrnoStatus("cannot write", path);
  }
  return absl::OkStatus();
}

// A hole's name in the messages: "<optimizer>\n<index>/<key>".
std::string HoleName(const std::string& optimizer, int64_t index,
                     const std::string& key) {
  return absl::StrCat(optimizer, "\n", index, "/", key);
}

// Files opened for writing holes, each once, synced and closed together.
class HoleFiles {
 public:
  ~HoleFiles() {
    for (const auto& [path, fd] : fds_) ::close(fd);
  }
  // The descriptor of `path`, opened read-write; -1 (errno set) when it
  // cannot be.
  int Open(const std::string& path) {
    auto it = fds_.find(path);
    if (it != fds_.end()) return it->second;
    const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd >= 0) fds_[path] = fd;
    return fd;
  }
  absl::Status SyncAll() {
    for (const auto& [path, fd] : fds_) {
      if (::fdatasync(fd) != 0) return ErrnoStatus("cannot sync", path);
    }
    return absl::OkStatus();
  }

 private:
  std::map<std::string, int> fds_;
};

std::string DescribeHole(const checkpoint::FileHole& h) {
  return absl::StrCat("optimizer '", h.optimizer, "' parameter ", h.index, " '",
                      h.key, "'");
}

struct Hole {
  checkpoint::FileHole where;
  at::Tensor bytes;  // this rank's, contiguous on the CPU
};

// A rank's answer to the writer's holes: "" (none of them is this rank's),
// "ok <n>" (it wrote its n), "E<why>" (it failed to) or "B<archive>" (it
// does not see the writer's files: its entries, for the writer to write).
std::string WriteOwnHoles(const nlohmann::json& table,
                          std::vector<ZeroRedundancyOptimizer*>& zeros,
                          const std::vector<std::string>& names) {
  std::map<std::string, at::Tensor> mine;
  for (size_t k = 0; k < zeros.size(); ++k) {
    for (auto& [entry, t] : detail::ZeroShard(*zeros[k])) {
      mine[HoleName(names[k], entry.first, entry.second)] = std::move(t);
    }
  }
  std::vector<Hole> holes;
  std::map<std::string, Ranges> ranges;  // every hole, by file
  try {
    for (const nlohmann::json& h : table.at("holes")) {
      checkpoint::FileHole f{
          h.at(0).get<std::string>(), h.at(1).get<int64_t>(),
          h.at(2).get<std::string>(), h.at(3).get<std::string>(),
          h.at(4).get<uint64_t>(),    h.at(5).get<uint64_t>()};
      ranges[f.path].emplace_back(f.offset, f.bytes);
      auto it = mine.find(HoleName(f.optimizer, f.index, f.key));
      if (it != mine.end()) holes.push_back({std::move(f), it->second});
    }
  } catch (const std::exception& e) {
    return absl::StrCat("Ea malformed list of holes: ", e.what());
  }
  if (holes.empty()) return "";
  int64_t test = 0;  // 1: as if unseen; 2: a write that fails
  if (!env::GetInt(env::kTestCheckpointHoles, &test).ok()) test = 0;
  if (test == 2) return "Etest fault (CONCORD_TEST_CHECKPOINT_HOLES=2)";
  // Whether this rank sees the writer's files: each one's size and first
  // bytes (its holes as zeros) as the writer said.
  HoleFiles files;
  bool seen = test == 0;
  std::set<std::string> checked;
  for (const Hole& h : holes) {
    if (!seen) break;
    if (!checked.insert(h.where.path).second) continue;
    const int fd = files.Open(h.where.path);
    if (fd < 0) {
      seen = false;
      break;
    }
    const auto print = Fingerprint(fd, h.where.path, ranges[h.where.path]);
    seen = print.ok() && Matches(table, h.where.path, *print);
  }
  if (!seen) {
    NamedTensors out;
    for (const Hole& h : holes) {
      out.emplace_back(HoleName(h.where.optimizer, h.where.index, h.where.key),
                       h.bytes);
    }
    auto archive = EncodeStateDict(out);
    if (!archive.ok()) return absl::StrCat("E", archive.status().message());
    return absl::StrCat("B", std::string(archive->begin(), archive->end()));
  }
  for (const Hole& h : holes) {
    const size_t n =
        static_cast<size_t>(h.bytes.numel()) * h.bytes.element_size();
    if (n != h.where.bytes) {
      return absl::StrCat("E", DescribeHole(h.where), " is ", h.where.bytes,
                          " bytes, this rank's ", n);
    }
    const absl::Status s = WriteAt(files.Open(h.where.path), h.where.path,
                                   h.bytes.data_ptr(), n, h.where.offset);
    if (!s.ok()) return absl::StrCat("E", s.message());
  }
  const absl::Status synced = files.SyncAll();
  if (!synced.ok()) return absl::StrCat("E", synced.message());
  return absl::StrCat("ok ", holes.size());
}

// Whether the other ranks heard of the holes (and wait for the outcome),
// and whether the collectives still work.
struct Announced {
  bool told = false;
  bool reachable = true;
  // Holes filled by the ranks holding them, and by the writer from bytes.
  size_t by_ranks = 0, from_bytes = 0;
};

// The writer's side, once its files are written with holes: says where
// they are, writes those of ranks that sent bytes, and checks that every
// hole was filled.
absl::Status FillHoles(comm::Communicator& comm,
                       const comm::CollectiveOptions& options,
                       const std::vector<checkpoint::FileHole>& holes,
                       Announced* announced) {
  nlohmann::json table = {{"fill", true},
                          {"holes", nlohmann::json::array()},
                          {"files", nlohmann::json::object()}};
  std::map<std::string, const checkpoint::FileHole*> by_name;
  {
    HoleFiles files;
    for (const checkpoint::FileHole& h : holes) {
      table["holes"].push_back(
          {h.optimizer, h.index, h.key, h.path, h.offset, h.bytes});
      by_name[HoleName(h.optimizer, h.index, h.key)] = &h;
      if (table["files"].contains(h.path)) continue;
      const int fd = files.Open(h.path);
      if (fd < 0) return ErrnoStatus("cannot open", h.path);
      Ranges ranges;
      for (const checkpoint::FileHole& other : holes) {
        if (other.path == h.path) {
          ranges.emplace_back(other.offset, other.bytes);
        }
      }
      CONCORD_ASSIGN_OR_RETURN(const auto print,
                               Fingerprint(fd, h.path, ranges));
      table["files"][h.path] = {print.first, print.second};
    }
  }
  std::string bytes = table.dump();
  announced->told = true;
  announced->reachable = false;
  CONCORD_RETURN_IF_ERROR(comm::BroadcastBytes(comm, kWriter, &bytes, options));
  CONCORD_ASSIGN_OR_RETURN(
      const std::vector<std::string> answers,
      comm::GatherStrings(comm, std::string(), {kWriter}, options));
  announced->reachable = true;
  size_t filled = 0;
  HoleFiles files;
  for (size_t r = 0; r < answers.size(); ++r) {
    const std::string& a = answers[r];
    if (a.empty()) continue;
    if (a[0] == 'E') {
      return absl::UnavailableError(
          absl::StrCat("rank ", r,
                       " could not write its shard into the "
                       "checkpoint: ",
                       a.substr(1)));
    }
    if (a[0] != 'B') {
      size_t n = 0;
      if (!absl::StartsWith(a, "ok ") || !absl::SimpleAtoi(a.substr(3), &n)) {
        return absl::InternalError(
            absl::StrCat("rank ", r, ": a malformed answer to the holes"));
      }
      filled += n;
      announced->by_ranks += n;
      continue;
    }
    // A rank that does not share the writer's filesystem: its bytes.
    CONCORD_ASSIGN_OR_RETURN(
        const c10::IValue sent,
        ReadArchive(std::vector<char>(a.begin() + 1, a.end())));
    if (!sent.isGenericDict()) {
      return absl::InternalError(
          absl::StrCat("rank ", r, ": its shard's bytes are not a dict"));
    }
    for (const auto& e : sent.toGenericDict()) {
      const auto it = by_name.find(e.key().toStringRef());
      const at::Tensor t = e.value().toTensor().contiguous();
      const size_t n = static_cast<size_t>(t.numel()) * t.element_size();
      if (it == by_name.end() || it->second->bytes != n) {
        return absl::InternalError(absl::StrCat(
            "rank ", r, " sent an entry the checkpoint has no hole for"));
      }
      const checkpoint::FileHole& h = *it->second;
      const int fd = files.Open(h.path);
      if (fd < 0) return ErrnoStatus("cannot open", h.path);
      CONCORD_RETURN_IF_ERROR(WriteAt(fd, h.path, t.data_ptr(), n, h.offset));
      ++filled;
      ++announced->from_bytes;
    }
  }
  CONCORD_RETURN_IF_ERROR(files.SyncAll());
  if (filled != holes.size()) {
    return absl::InternalError(absl::StrCat(
        "the checkpoint has ", holes.size(),
        " holes of sharded optimizer state and the ranks filled ", filled));
  }
  return absl::OkStatus();
}

}  // namespace

CheckpointState& CheckpointState::add_module(
    const std::string& name, std::shared_ptr<torch::nn::Module> module) {
  std::set<std::string> taken;
  for (const auto& [n, m] : modules_) taken.insert(n);
  CheckName(name, taken);
  if (module == nullptr) {
    throw Error(
        ErrorCode::kInvalidArgument,
        absl::StrCat("CheckpointState::add('", name, "'): an empty module"));
  }
  modules_.emplace_back(name, std::move(module));
  return *this;
}

CheckpointState& CheckpointState::add(const std::string& name,
                                      torch::optim::Optimizer& optimizer) {
  std::set<std::string> taken;
  for (const auto& [n, o] : optimizers_) taken.insert(n);
  CheckName(name, taken);
  optimizers_.emplace_back(name, &optimizer);
  return *this;
}

void save_checkpoint(const Job& job, const std::string& dir, int64_t step,
                     const CheckpointState& state, int keep) {
  if (step < 1 || keep < 1) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("save_checkpoint: step ", step, " and keep ", keep,
                             " must be at least 1"));
  }
  // A sharded optimizer's state (a collective: every rank calls
  // save_checkpoint): each rank writes its shard into rank 0's file (see
  // Note [Shards written where they are] in worker/checkpoint/disk.h), or
  // with CONCORD_TEST_SHARDS_AS_BYTES sends it to rank 0.
  int64_t as_bytes = 0;
  if (!env::GetInt(env::kTestShardsAsBytes, &as_bytes).ok()) as_bytes = 0;
  const bool in_file = as_bytes == 0 && job.world_size() > 1;
  std::map<std::string, checkpoint::OptimizerContent> sharded;
  std::vector<ZeroRedundancyOptimizer*> zeros;
  std::vector<std::string> zero_names;
  for (const auto& [name, optimizer] : state.optimizers()) {
    if (auto* zero = dynamic_cast<ZeroRedundancyOptimizer*>(optimizer)) {
      sharded[name] = detail::ZeroCheckpoint(*zero, name, kWriter, in_file);
      zeros.push_back(zero);
      zero_names.push_back(name);
    }
  }
  const bool holes = in_file && !zeros.empty();
  std::pair<comm::Communicator*, comm::CollectiveOptions> comm{nullptr, {}};
  if (holes) comm = detail::ZeroComm(*zeros.front());
  if (job.rank() != kWriter) {
    if (!holes) return;
    // Where rank 0 put the holes (or how its write ended without any), this
    // rank's answer, and how the checkpoint ended.
    std::string bytes;
    ThrowIfError(
        comm::BroadcastBytes(*comm.first, kWriter, &bytes, comm.second));
    const nlohmann::json table =
        nlohmann::json::parse(bytes, nullptr, /*allow_exceptions=*/false);
    if (!table.is_object()) {
      ThrowIfError(absl::InternalError("save_checkpoint: a malformed message"));
    }
    if (!table.value("fill", false)) {
      ThrowIfError(StatusOf(table.value("outcome", nlohmann::json())));
      return;
    }
    ThrowIfError(comm::GatherStrings(*comm.first,
                                     WriteOwnHoles(table, zeros, zero_names),
                                     {kWriter}, comm.second)
                     .status());
    ThrowIfError(
        comm::BroadcastBytes(*comm.first, kWriter, &bytes, comm.second));
    ThrowIfError(StatusOf(
        nlohmann::json::parse(bytes, nullptr, /*allow_exceptions=*/false)));
    return;
  }
  checkpoint::Content c;
  c.counters.step = step;
  c.counters.world_size = job.world_size();
  c.counters.generation = job.generation();
  c.counters.run = job.state()->session().run();
  for (const auto& [name, module] : state.modules()) {
    c.modules.emplace_back(name, NamedStateOf(*module));
  }
  for (const auto& [name, optimizer] : state.optimizers()) {
    auto it = sharded.find(name);
    c.optimizers.push_back(
        it != sharded.end() ? std::move(it->second)
                            : checkpoint::CaptureOptimizer(name, *optimizer));
  }
  for (const auto& [name, v] : state.values()) {
    c.extra.emplace_back(absl::StrCat("values/", name), v);
  }
  checkpoint::WriteOptions options;
  options.keep = keep;
  Announced announced;
  if (holes) {
    options.fill_holes =
        [&](const std::vector<checkpoint::FileHole>& list) -> absl::Status {
      return FillHoles(*comm.first, comm.second, list, &announced);
    };
  }
  auto written = checkpoint::WriteCheckpoint(
      c, dir, job.state()->session().options().spec.job_id(), options);
  if (holes && announced.reachable) {
    // The outcome, to every rank: the checkpoint is theirs as well.
    std::string bytes =
        announced.told
            ? StatusJson(written.status()).dump()
            : nlohmann::json{{"fill", false},
                             {"outcome", StatusJson(written.status())}}
                  .dump();
    const absl::Status told =
        comm::BroadcastBytes(*comm.first, kWriter, &bytes, comm.second);
    if (written.ok()) ThrowIfError(told);
  }
  ThrowIfError(written.status());
  if (announced.told) {
    Log()->info(
        "save_checkpoint: step {}: {} tensors of sharded optimizer state "
        "written into it by the ranks holding them, {} by rank 0 from their "
        "bytes",
        step, announced.by_ranks, announced.from_bytes);
  }
}

std::optional<int64_t> load_checkpoint(const Job& job, const std::string& dir,
                                       CheckpointState& state) {
  auto loaded = checkpoint::LoadNewest(
      dir, job.state()->session().options().spec.job_id());
  if (absl::IsNotFound(loaded.status())) return std::nullopt;
  ThrowIfError(loaded.status());
  const checkpoint::Content& c = loaded->content;
  checkpoint::Live live;
  for (const auto& [name, module] : state.modules()) {
    live.modules.emplace_back(name, NamedStateOf(*module));
  }
  // A sharded optimizer takes its shards from the whole state, checked
  // first (nothing changes when anything does not fit).
  std::vector<std::pair<ZeroRedundancyOptimizer*,
                        std::shared_ptr<torch::optim::Optimizer>>>
      sharded;
  for (const auto& [name, optimizer] : state.optimizers()) {
    auto* zero = dynamic_cast<ZeroRedundancyOptimizer*>(optimizer);
    if (zero == nullptr) {
      live.optimizers.emplace_back(name, optimizer);
      continue;
    }
    const checkpoint::OptimizerContent* saved = nullptr;
    for (const auto& o : c.optimizers) {
      if (o.name == name) saved = &o;
    }
    absl::StatusOr<std::shared_ptr<torch::optim::Optimizer>> whole =
        saved == nullptr ? absl::FailedPreconditionError(absl::StrCat(
                               "the checkpoint has no optimizer '", name, "'"))
                         : detail::ZeroCheck(*zero, *saved);
    if (!whole.ok()) {
      throw Error(ErrorCode::kFailedPrecondition,
                  absl::StrCat("load_checkpoint: ", whole.status().message()));
    }
    sharded.emplace_back(zero, *std::move(whole));
  }
  auto values = checkpoint::ApplyTo(c, live);
  if (!values.ok()) {
    throw Error(ErrorCode::kFailedPrecondition,
                absl::StrCat("load_checkpoint: ", values.status().message()));
  }
  for (const auto& [zero, whole] : sharded) detail::ZeroApply(*zero, *whole);
  state.values() = *std::move(values);
  return c.counters.step;
}

}  // namespace concord
