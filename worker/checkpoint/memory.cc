#include "worker/checkpoint/memory.h"

#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/zip_writer.h"

namespace concord::checkpoint {
namespace {

constexpr char kMagic[8] = {'C', 'O', 'N', 'C', 'K', 'P', 'T', '1'};
constexpr uint32_t kVersion = 4;  // 4: a job id of 128 characters

size_t Aligned(size_t n, size_t to = ZipWriter::kAlign) {
  return (n + to - 1) / to * to;
}
// Where a tensor of `bytes` goes at or after `offset`: a big one at a page,
// so that the disk tier writes it from the region (see Note [Archive
// writer] in worker/zip_writer.h), others at 64 bytes.
size_t Place(size_t offset, size_t bytes) {
  return Aligned(offset, bytes >= ZipWriter::kPageAlignedMin
                             ? ZipWriter::kPageAlign
                             : ZipWriter::kAlign);
}
// Where the tensors start, after the layout that ends at `layout_end`.
size_t DataOffset(size_t layout_end) {
  return Aligned(layout_end, ZipWriter::kPageAlign);
}

// Where a content's parts go in a region (see Note [Snapshot region]).
struct Layout {
  Flat flat;
  nlohmann::json table = nlohmann::json::array();  // each tensor's place
  std::string layout;                              // the JSON written
  size_t data_offset = 0;
  size_t bytes = 0;  // the region's size it needs
};

Layout LayOut(const Content& content) {
  Layout l;
  l.flat = Flatten(content);
  size_t offset = 0;
  for (const at::Tensor& t : l.flat.tensors) {
    const size_t bytes = t.numel() * t.element_size();
    offset = Place(offset, bytes);
    l.table.push_back({{"dtype", static_cast<int>(t.scalar_type())},
                       {"shape", t.sizes().vec()},
                       {"offset", offset}});
    offset += bytes;
  }
  l.layout = nlohmann::json{{"skeleton", l.flat.skeleton}, {"tensors", l.table}}
                 .dump();
  l.data_offset = DataOffset(kHeaderBytes + l.layout.size());
  l.bytes = l.data_offset + offset;
  return l;
}

}  // namespace

size_t SnapshotBytes(const Content& content) { return LayOut(content).bytes; }

absl::StatusOr<WriteResult> LayOutSnapshot(Region& region,
                                           const Content& content,
                                           const std::string& job, bool persist,
                                           PendingSnapshot* pending) {
  Layout laid = LayOut(content);
  RegionHeader* h = &region.header();
  // Claim the region first: a persister reading it must not see it remapped.
  uint32_t s = h->state.load(std::memory_order_acquire);
  do {
    if (s == RegionHeader::kPersisting) {
      h->skipped.fetch_add(1, std::memory_order_relaxed);
      return WriteResult::kSkippedBusy;
    }
  } while (!h->state.compare_exchange_weak(s, RegionHeader::kWriting,
                                           std::memory_order_acq_rel));
  if (absl::Status grown = region.Reserve(laid.bytes); !grown.ok()) {
    // Nothing was written (a failed Reserve leaves the mapping as it was):
    // the last snapshot, complete or not, is what the region holds.
    region.header().state.store(s, std::memory_order_release);
    return grown;
  }
  h = &region.header();
  std::memcpy(h->magic, kMagic, sizeof(kMagic));
  h->version = kVersion;
  h->writer_pid = static_cast<int32_t>(::getpid());
  std::memcpy(region.base() + kHeaderBytes, laid.layout.data(),
              laid.layout.size());
  // The header says where everything is before any tensor is copied: the
  // node's other workers fill the holes from it (ReadLaidOut).
  h->step = content.counters.step;
  h->layout_offset = kHeaderBytes;
  h->layout_size = laid.layout.size();
  h->bytes = laid.bytes;
  h->persist = persist ? 1 : 0;
  std::memset(h->job, 0, sizeof(h->job));
  std::memcpy(h->job, job.data(), std::min(job.size(), sizeof(h->job) - 1));
  PendingSnapshot p{&region, content.counters.step, {}, {}};
  p.tensors = std::move(laid.flat.tensors);
  for (const nlohmann::json& t : laid.table) {
    p.offsets.push_back(laid.data_offset + t["offset"].get<size_t>());
  }
  *pending = std::move(p);
  return WriteResult::kWritten;
}

void CopySnapshot(const PendingSnapshot& pending) {
  torch::NoGradGuard no_grad;
  char* base = pending.region->base();
  for (size_t i = 0; i < pending.tensors.size(); ++i) {
    const at::Tensor& t = pending.tensors[i];
    // A hole (see Note [Holes]) is another worker's to fill.
    if (t.numel() == 0 || t.is_meta()) continue;
    char* to = base + pending.offsets[i];
    if (t.device().is_cpu() && t.is_contiguous()) {
      // A plain copy: LibTorch's copy_ splits a large one over its
      // threads, which stalls when the cores are busy with training.
      std::memcpy(to, t.data_ptr(), t.numel() * t.element_size());
      continue;
    }
    at::Tensor dst = torch::from_blob(
        to, t.sizes(),
        torch::TensorOptions().dtype(t.scalar_type()).device(torch::kCPU));
    dst.copy_(t);
  }
}

absl::StatusOr<WriteResult> BeginSnapshot(Region& region,
                                          const Content& content,
                                          const std::string& job, bool persist,
                                          PendingSnapshot* pending) {
  CONCORD_ASSIGN_OR_RETURN(
      const WriteResult r,
      LayOutSnapshot(region, content, job, persist, pending));
  if (r == WriteResult::kWritten) CopySnapshot(*pending);
  return r;
}

bool HasHoles(const Content& content) {
  for (const OptimizerContent& o : content.optimizers) {
    for (const auto& [index, tensors] : o.state) {
      for (const auto& [key, t] : tensors) {
        if (t.is_meta()) return true;
      }
    }
  }
  return false;
}

void DropSnapshot(const PendingSnapshot& pending) {
  pending.region->header().state.store(RegionHeader::kEmpty,
                                       std::memory_order_release);
}

absl::StatusOr<int64_t> FinishSnapshot(const PendingSnapshot& pending,
                                       double stall_seconds,
                                       const Versions& live) {
  RegionHeader* h = &pending.region->header();
  for (const auto& [t, version] : live) {
    if (t._version() != version) {
      h->state.store(RegionHeader::kEmpty, std::memory_order_release);
      return absl::AbortedError(absl::StrCat(
          "a tensor of ", DescribeTensor(t),
          " was written in place between the commit and the end of its "
          "copy"));
    }
  }
  h->stall_ns = static_cast<uint64_t>(stall_seconds * 1e9);
  h->sequence.fetch_add(1, std::memory_order_acq_rel);
  h->state.store(RegionHeader::kReady, std::memory_order_release);
  pending.region->Ring();  // the persister, in this process or the agent's
  return pending.step;
}

absl::StatusOr<WriteResult> WriteSnapshot(Region& region,
                                          const Content& content,
                                          const std::string& job,
                                          bool persist) {
  const auto start = std::chrono::steady_clock::now();
  PendingSnapshot pending;
  CONCORD_ASSIGN_OR_RETURN(
      const WriteResult r,
      BeginSnapshot(region, content, job, persist, &pending));
  if (r != WriteResult::kWritten) return r;
  const double stall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  CONCORD_RETURN_IF_ERROR(FinishSnapshot(pending, stall).status());
  return WriteResult::kWritten;
}

Staged Stage(const Content& content, const std::vector<at::Tensor>& deferred) {
  std::unordered_set<const c10::TensorImpl*> later;
  for (const at::Tensor& t : deferred) later.insert(t.unsafeGetTensorImpl());
  Flat flat = Flatten(content);
  Staged staged;
  torch::NoGradGuard no_grad;
  for (at::Tensor& t : flat.tensors) {
    if (t.is_meta()) continue;  // a hole stays one (see Note [Holes])
    if (t.device().is_cpu() && later.count(t.unsafeGetTensorImpl()) > 0) {
      staged.live.emplace_back(t, t._version());
    } else {
      t = t.to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true);
    }
  }
  absl::StatusOr<Content> unflat = Unflatten(flat.skeleton, flat.tensors);
  // Flatten's own skeleton always unflattens.
  TORCH_INTERNAL_ASSERT(unflat.ok(), std::string(unflat.status().message()));
  staged.content = *std::move(unflat);
  return staged;
}

namespace {

// The content a region's header and layout describe, its tensors views of
// the region (the header's state and version checked by the caller).
absl::StatusOr<Content> ReadLayout(Region& region) {
  CONCORD_RETURN_IF_ERROR(region.MapAll());
  const RegionHeader& mapped = region.header();
  if (mapped.layout_offset + mapped.layout_size > region.mapped()) {
    return absl::InvalidArgumentError("a snapshot's layout past its region");
  }
  nlohmann::json layout = nlohmann::json::parse(
      region.base() + mapped.layout_offset,
      region.base() + mapped.layout_offset + mapped.layout_size, nullptr,
      /*allow_exceptions=*/false);
  if (layout.is_discarded() || !layout.contains("tensors") ||
      !layout.contains("skeleton")) {
    return absl::InvalidArgumentError("a snapshot's layout is not JSON");
  }
  const size_t data_offset =
      DataOffset(mapped.layout_offset + mapped.layout_size);
  std::vector<at::Tensor> tensors;
  try {
    for (const nlohmann::json& t : layout.at("tensors")) {
      const auto dtype = static_cast<c10::ScalarType>(t.at("dtype").get<int>());
      const std::vector<int64_t> shape =
          t.at("shape").get<std::vector<int64_t>>();
      const size_t offset = data_offset + t.at("offset").get<size_t>();
      int64_t numel = 1;
      for (int64_t d : shape) numel *= d;
      if (offset + static_cast<size_t>(numel) * c10::elementSize(dtype) >
          mapped.bytes) {
        return absl::InvalidArgumentError("a snapshot's tensor past its end");
      }
      tensors.push_back(torch::from_blob(
          region.base() + offset, shape,
          torch::TensorOptions().dtype(dtype).device(torch::kCPU)));
    }
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("a snapshot's tensor table: ", e.what()));
  }
  return Unflatten(layout.at("skeleton"), tensors);
}

}  // namespace

absl::StatusOr<Content> ReadSnapshot(Region& region) {
  const RegionHeader& h = region.header();
  const uint32_t s = h.state.load(std::memory_order_acquire);
  if (std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0 ||
      (s != RegionHeader::kReady && s != RegionHeader::kPersisting)) {
    return absl::NotFoundError("no complete snapshot in memory");
  }
  if (h.version != kVersion) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a snapshot of format ", h.version, ", expected ", kVersion));
  }
  return ReadLayout(region);
}

absl::StatusOr<Content> ReadLaidOut(Region& region, int64_t step,
                                    int32_t writer_pid) {
  const RegionHeader& h = region.header();
  const uint32_t s = h.state.load(std::memory_order_acquire);
  if (std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0 ||
      h.version != kVersion || s != RegionHeader::kWriting ||
      h.writer_pid != writer_pid || h.step != step) {
    return absl::FailedPreconditionError(
        absl::StrCat("the node's snapshot region does not hold step ", step,
                     " being written by pid ", writer_pid, " (it says step ",
                     h.step, ", pid ", h.writer_pid, ", state ", s, ")"));
  }
  return ReadLayout(region);
}

}  // namespace concord::checkpoint
