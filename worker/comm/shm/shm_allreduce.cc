#include "worker/comm/shm/shm_allreduce.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstring>
#include <fstream>
#include <new>
#include <random>
#include <sstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"

namespace concord::comm {

namespace {

constexpr uint64_t kMagic = 0x636f6e636f726431ULL;  // "concord1"
constexpr size_t kAlign = 4096;
// What gloo/allreduce.h's AllreduceOptions::kMaxSegmentSize is.
constexpr size_t kGlooMaxSegmentBytes = 1024 * 1024;
// The most a job maps, both sets of every rank's slot.
constexpr size_t kMaxMappedBytes = 32 << 20;
constexpr size_t kMinWindowBytes = 64 << 10;
constexpr absl::Duration kCheckEvery = absl::Milliseconds(20);

size_t RoundUp(size_t a, size_t b) { return (a + b - 1) / b * b; }

std::string Errno(const char* what) {
  return absl::StrCat(what, ": ", std::strerror(errno));
}

// A process's state and start time (/proc/PID/stat fields 3 and 22): a
// pid reused by another process has another start time.
struct ProcStat {
  char state = '?';
  uint64_t start_time = 0;
};

bool ReadProcStat(int pid, ProcStat* out) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(f, line)) return false;
  // The command name, field 2, is in parentheses and may hold spaces.
  const size_t close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return false;
  std::vector<std::string> fields =
      absl::StrSplit(line.substr(close + 2), ' ', absl::SkipEmpty());
  // fields[0] is field 3 (state); field 22 is fields[19].
  if (fields.size() < 20 || fields[0].empty()) return false;
  out->state = fields[0][0];
  return absl::SimpleAtoi(fields[19], &out->start_time);
}

long Futex(std::atomic<uint32_t>* word, int op, uint32_t value,
           const struct timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value,
                 timeout, nullptr, 0);
}

// Element type of a sum, as Gloo's sum<T>: c = a + b, element by element.
template <typename T>
void Add(T* out, const T* a, const T* b, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

}  // namespace

struct ShmAllreduce::Header {
  uint64_t magic;
  int32_t size;
  uint32_t unused;
  uint64_t window_bytes;
  uint64_t bytes;
  alignas(64) std::atomic<uint32_t> arrived;  // the barriers' futex word
  alignas(64) std::atomic<uint32_t> aborted;  // 0, or 1 + the rank that did
};

// One per rank, after the header: who to check for liveness.
struct ShmAllreduce::Peer {
  std::atomic<int32_t> pid;
  uint64_t start_time;
};

size_t ShmAllreduce::HeaderBytes(int size) {
  return RoundUp(
      RoundUp(sizeof(Header), 64) + sizeof(Peer) * static_cast<size_t>(size),
      kAlign);
}

ShmAllreduce::Peer* ShmAllreduce::peers() const {
  return reinterpret_cast<Peer*>(static_cast<uint8_t*>(base_) +
                                 RoundUp(sizeof(Header), 64));
}

size_t GlooRingChunkElements(size_t elements, size_t element_size, int size) {
  const size_t w = static_cast<size_t>(size);
  const size_t total = elements * element_size;
  const size_t max_segment =
      element_size * std::max<size_t>(1, kGlooMaxSegmentBytes / element_size);
  const size_t segments =
      RoundUp(std::max((total + max_segment - 1) / max_segment, w * 2), w);
  const size_t segment_bytes =
      RoundUp((total + segments - 1) / segments, element_size);
  return std::max<size_t>(1, segments / w * segment_bytes / element_size);
}

ShmAllreduce::ShmAllreduce(const ShmAllreduceOptions& options, void* base,
                           size_t bytes)
    : options_(options),
      base_(base),
      bytes_(bytes),
      header_(static_cast<Header*>(base)) {}

ShmAllreduce::~ShmAllreduce() {
  if (base_ == nullptr) return;
  Abort();
  munmap(base_, bytes_);
}

uint8_t* ShmAllreduce::Slot(int set, int rank) const {
  const size_t index = static_cast<size_t>(set * options_.size + rank);
  return static_cast<uint8_t*>(base_) + HeaderBytes(options_.size) +
         index * options_.window_bytes;
}

// Create's state on one rank (see "Setup" in the header): the segment's
// name and mapping, and the first reason it cannot be used here (empty while
// all is well).
struct ShmAllreduce::Setup {
  Setup(const ShmAllreduceOptions& o, Store* store, size_t bytes)
      : o(o), store(store), bytes(bytes) {}

  const ShmAllreduceOptions& o;
  Store* store;
  size_t bytes;
  std::string name;
  std::string failure;
  void* base = MAP_FAILED;

  void Map(int fd) {
    base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) failure = Errno("mmap");
  }

  // Rank 0: makes, maps and fills in the segment, then names it in the
  // store ("" when it could not, or shared memory is off here).
  absl::Status MakeSegment() {
    if (failure.empty()) {
      std::random_device random;
      name = absl::StrCat("/concord-", getpid(), "-", random(), random());
      const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0) {
        failure = Errno("shm_open");
      } else if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
        failure = Errno("ftruncate");
      } else if (int e = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
                 e != 0) {
        failure = absl::StrCat("posix_fallocate of ", bytes,
                               " bytes: ", std::strerror(e));
      } else {
        Map(fd);
      }
      if (fd >= 0) close(fd);
      if (failure.empty()) {
        Header* h = new (base) Header();
        h->size = o.size;
        h->window_bytes = o.window_bytes;
        h->bytes = bytes;
        h->magic = kMagic;
      } else {
        if (fd >= 0) shm_unlink(name.c_str());
        name.clear();
      }
    }
    if (absl::Status s = store->Set("shm/name", name); !s.ok()) {
      if (base != MAP_FAILED) munmap(base, bytes);
      if (!name.empty()) shm_unlink(name.c_str());
      return s;
    }
    return absl::OkStatus();
  }

  // The other ranks: map what rank 0 named, and check it is this group's.
  absl::Status MapNamed() {
    auto got = store->Get({"shm/name"}, o.setup_timeout);
    if (!got.ok()) return got.status();
    name = got->front();
    int fd = -1;
    struct stat st;
    if (!failure.empty()) {
      // Not mapped: this rank's verdict is already no.
    } else if (name.empty()) {
      failure = "rank 0 could not make the segment";
    } else if ((fd = shm_open(name.c_str(), O_RDWR, 0)) < 0) {
      failure = Errno("shm_open");  // another host, another IPC namespace
    } else if (fstat(fd, &st) != 0 ||
               static_cast<size_t>(st.st_size) != bytes) {
      failure = "the segment has another size";
    } else {
      Map(fd);
    }
    if (fd >= 0) close(fd);
    if (failure.empty()) {
      const Header* h = static_cast<const Header*>(base);
      if (h->magic != kMagic || h->size != o.size ||
          h->window_bytes != o.window_bytes || h->bytes != bytes) {
        failure = "the segment is not this group's";
      }
    }
    return absl::OkStatus();
  }

  // A round: every rank says whether it is fine so far; rank 0 alone reads
  // them all and publishes the verdict ("1", or "0 " and the first rank's
  // reason), which the others read: O(size) store traffic, not O(size^2).
  // True when every rank was fine.
  absl::StatusOr<bool> Round(const std::string& what) {
    const std::string key = absl::StrCat("shm/", what);
    CONCORD_RETURN_IF_ERROR(store->Set(absl::StrCat(key, "/", o.rank),
                                       failure.empty() ? "1" : "0 " + failure));
    if (o.rank == 0) {
      // One key a read (any store takes that), stopping at the first "no":
      // ranks on several hosts say no early, and one host has few ranks.
      std::string verdict = "1";
      for (int r = 0; r < o.size && verdict == "1"; ++r) {
        auto said = store->Get({absl::StrCat(key, "/", r)}, o.setup_timeout);
        if (!said.ok()) return said.status();
        if (said->front() != "1") {
          verdict = absl::StrCat("0 rank ", r, ": ", said->front().substr(2));
        }
      }
      CONCORD_RETURN_IF_ERROR(store->Set(key, verdict));
    }
    auto verdict = store->Get({key}, o.setup_timeout);
    if (!verdict.ok()) return verdict.status();
    if (verdict->front() != "1" && failure.empty()) {
      failure = verdict->front().substr(2);
    }
    return failure.empty();
  }

  // Every peer's pid names that peer here (one pid namespace).
  void CheckPeersVisible(const ShmAllreduce& group) {
    for (int r = 0; r < o.size && failure.empty(); ++r) {
      ProcStat st;
      const Peer& peer = group.peers()[r];
      const int pid = peer.pid.load(std::memory_order_acquire);
      if (!ReadProcStat(pid, &st) || st.start_time != peer.start_time) {
        failure = absl::StrCat("rank ", r, "'s pid ", pid,
                               " is not visible here (another pid namespace)");
      }
    }
  }
};

absl::StatusOr<std::unique_ptr<ShmAllreduce>> ShmAllreduce::Create(
    const ShmAllreduceOptions& options, Store* store) {
  if (options.size < 2 || options.rank < 0 || options.rank >= options.size) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shared memory: rank ", options.rank, " of ", options.size));
  }
  ShmAllreduceOptions o = options;
  // Two sets of `size` slots within kMaxMappedBytes, whole pages.
  o.window_bytes =
      std::max(kMinWindowBytes,
               std::min(o.window_bytes,
                        kMaxMappedBytes / (2 * static_cast<size_t>(o.size))) /
                   kAlign * kAlign);
  Setup setup{
      o, store,
      HeaderBytes(o.size) + 2 * static_cast<size_t>(o.size) * o.window_bytes};
  if (!o.enabled) setup.failure = "turned off (CONCORD_SHM=0)";
  CONCORD_RETURN_IF_ERROR(o.rank == 0 ? setup.MakeSegment() : setup.MapNamed());
  std::unique_ptr<ShmAllreduce> group;
  if (setup.base != MAP_FAILED) {
    group.reset(new ShmAllreduce(o, setup.base, setup.bytes));
  }
  ProcStat self;
  if (setup.failure.empty() && !ReadProcStat(getpid(), &self)) {
    setup.failure = "cannot read /proc/self/stat";
  }
  if (setup.failure.empty()) {
    Peer& me = group->peers()[o.rank];
    me.start_time = self.start_time;
    me.pid.store(getpid(), std::memory_order_release);
  }
  // Round 1: every rank has mapped the segment (or failed); rank 0 unlinks
  // its name.
  absl::StatusOr<bool> mapped = setup.Round("mapped");
  if (o.rank == 0 && !setup.name.empty()) shm_unlink(setup.name.c_str());
  if (!mapped.ok()) return mapped.status();
  // Round 2: every peer visible from here.
  if (setup.failure.empty()) setup.CheckPeersVisible(*group);
  CONCORD_RETURN_IF_ERROR(setup.Round("checked").status());
  if (!setup.failure.empty()) {
    if (group) {
      // Nobody uses it: no peer to fail.
      munmap(group->base_, group->bytes_);
      group->base_ = nullptr;
    }
    return absl::FailedPreconditionError(
        absl::StrCat("shared memory: ", setup.failure));
  }
  return group;
}

void ShmAllreduce::Abort() {
  if (base_ == nullptr) return;
  uint32_t expected = 0;
  header_->aborted.compare_exchange_strong(
      expected, static_cast<uint32_t>(options_.rank + 1));
  Futex(&header_->arrived, FUTEX_WAKE, INT_MAX, nullptr);
}

absl::Status ShmAllreduce::PeersAlive() const {
  for (int r = 0; r < options_.size; ++r) {
    if (r == options_.rank) continue;
    const Peer& peer = peers()[r];
    const int pid = peer.pid.load(std::memory_order_acquire);
    ProcStat st;
    if (!ReadProcStat(pid, &st) || st.state == 'Z' || st.state == 'X' ||
        st.start_time != peer.start_time) {
      return absl::UnavailableError(absl::StrCat(
          "shared memory allreduce: rank ", r, " (pid ", pid, ") exited"));
    }
  }
  return absl::OkStatus();
}

absl::Status ShmAllreduce::Barrier(absl::Time deadline) {
  const uint32_t target =
      (barriers_ + 1) * static_cast<uint32_t>(options_.size);
  ++barriers_;
  const auto reached = [target](uint32_t v) {
    return static_cast<int32_t>(v - target) >= 0;
  };
  const auto aborted = [this]() -> absl::Status {
    const uint32_t by = header_->aborted.load(std::memory_order_acquire);
    if (by == 0) return absl::OkStatus();
    return absl::UnavailableError(
        by == static_cast<uint32_t>(options_.rank + 1)
            ? std::string("shared memory allreduce: aborted")
            : absl::StrCat("shared memory allreduce: rank ", by - 1,
                           " ended the group (it left, was aborted or saw a "
                           "collective fail)"));
  };
  if (absl::Status s = aborted(); !s.ok()) return s;
  uint32_t v = header_->arrived.fetch_add(1, std::memory_order_acq_rel) + 1;
  if (reached(v)) {
    Futex(&header_->arrived, FUTEX_WAKE, INT_MAX, nullptr);
    return absl::OkStatus();
  }
  // A short spin (the peers are often a few microseconds away), then sleep:
  // ranks share the cores with their own compute.
  for (int spin = 0; spin < 256; ++spin) {
    if (reached(header_->arrived.load(std::memory_order_acquire))) {
      return absl::OkStatus();
    }
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  absl::Time next_check = absl::Now() + kCheckEvery;
  for (;;) {
    v = header_->arrived.load(std::memory_order_acquire);
    if (reached(v)) return absl::OkStatus();
    if (absl::Status s = aborted(); !s.ok()) return s;
    const absl::Time now = absl::Now();
    if (now >= next_check) {
      if (absl::Status s = PeersAlive(); !s.ok()) return s;
      if (now >= deadline) {
        return absl::UnavailableError(
            "shared memory allreduce: timed out waiting for the other ranks");
      }
      next_check = now + kCheckEvery;
    }
    const struct timespec wait =
        absl::ToTimespec(std::max(absl::ZeroDuration(), next_check - now));
    Futex(&header_->arrived, FUTEX_WAIT, v, &wait);
  }
}

template <typename T>
absl::Status ShmAllreduce::Sum(T* data, size_t n, absl::Duration timeout) {
  if (base_ == nullptr) {
    return absl::FailedPreconditionError("shared memory allreduce: closed");
  }
  const absl::Time deadline = absl::Now() + timeout;
  const int w = options_.size;
  const size_t window = options_.window_bytes / sizeof(T);
  // Gloo's ring chunks for the whole call, in elements.
  const size_t chunk = GlooRingChunkElements(n, sizeof(T), w);
  // A failed barrier ends the group, here and at every peer (as a broken
  // Gloo pair does): the barriers' count is no longer shared.
  const auto barrier = [&]() {
    absl::Status s = Barrier(deadline);
    if (!s.ok()) Abort();
    return s;
  };
  constexpr size_t kBlock = 2048;
  T scratch[kBlock];
  for (size_t off = 0; off < n; off += window) {
    const size_t len = std::min(window, n - off);
    const int set = static_cast<int>(windows_++ & 1);
    std::memcpy(Slot(set, options_.rank), data + off, len * sizeof(T));
    if (absl::Status s = barrier(); !s.ok()) return s;
    const auto share = [len, w](int r, size_t* lo, size_t* hi) {
      *lo = len * static_cast<size_t>(r) / static_cast<size_t>(w);
      *hi = len * static_cast<size_t>(r + 1) / static_cast<size_t>(w);
    };
    size_t lo, hi;
    share(options_.rank, &lo, &hi);
    T* mine = reinterpret_cast<T*>(Slot(set, options_.rank));
    for (size_t i = lo; i < hi;) {
      // The ring chunk of element off + i and where it ends.
      const int c = static_cast<int>((off + i) / chunk);
      const size_t end = std::min(
          {hi, (static_cast<size_t>(c) + 1) * chunk - off, i + kBlock});
      const auto in = [&](int j) {
        return reinterpret_cast<const T*>(Slot(set, (c + j) % w)) + i;
      };
      // a_c + (a_{c+1} + (... + (a_{c+w-2} + a_{c+w-1}))).
      Add(scratch, in(w - 2), in(w - 1), end - i);
      for (int j = w - 3; j >= 0; --j) Add(scratch, in(j), scratch, end - i);
      std::memcpy(mine + i, scratch, (end - i) * sizeof(T));
      i = end;
    }
    if (absl::Status s = barrier(); !s.ok()) return s;
    for (int r = 0; r < w; ++r) {
      share(r, &lo, &hi);
      std::memcpy(data + off + lo,
                  reinterpret_cast<const T*>(Slot(set, r)) + lo,
                  (hi - lo) * sizeof(T));
    }
  }
  return absl::OkStatus();
}

absl::Status ShmAllreduce::Broadcast(void* data, size_t bytes, int root,
                                     absl::Duration timeout) {
  if (base_ == nullptr) {
    return absl::FailedPreconditionError("shared memory broadcast: closed");
  }
  const absl::Time deadline = absl::Now() + timeout;
  auto* out = static_cast<uint8_t*>(data);
  const size_t window = options_.window_bytes;
  for (size_t off = 0; off < bytes; off += window) {
    const size_t len = std::min(window, bytes - off);
    const int set = static_cast<int>(windows_++ & 1);
    if (options_.rank == root) std::memcpy(Slot(set, root), out + off, len);
    if (absl::Status s = Barrier(deadline); !s.ok()) {
      Abort();  // as Sum's: the barriers' count is no longer shared
      return s;
    }
    if (options_.rank != root) std::memcpy(out + off, Slot(set, root), len);
  }
  return absl::OkStatus();
}

template absl::Status ShmAllreduce::Sum(float*, size_t, absl::Duration);
template absl::Status ShmAllreduce::Sum(double*, size_t, absl::Duration);
template absl::Status ShmAllreduce::Sum(int32_t*, size_t, absl::Duration);
template absl::Status ShmAllreduce::Sum(int64_t*, size_t, absl::Duration);

}  // namespace concord::comm
