#include "worker/comm/coalesced.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/tensor_ops.h"

namespace concord::comm {

absl::Status BroadcastCoalesced(Communicator& comm,
                                const std::vector<at::Tensor>& tensors,
                                int root, const CollectiveOptions& options) {
  if (comm.size() == 1 || tensors.empty()) return absl::OkStatus();
  at::NoGradGuard no_grad;
  std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (const auto& t : tensors) by_dtype[t.scalar_type()].push_back(t);

  std::vector<std::pair<at::Tensor, std::vector<at::Tensor>*>> flats;
  std::vector<std::shared_ptr<Work>> works;
  for (auto& [dtype, group] : by_dtype) {
    at::Tensor flat = FlattenTensors(group);
    works.push_back(comm.Broadcast(flat, root, options));
    flats.emplace_back(flat, &group);
  }
  for (auto& w : works) {
    if (absl::Status s = w->Synchronize(); !s.ok()) return s;
  }
  if (comm.rank() == root) return absl::OkStatus();
  for (auto& [flat, group] : flats) UnflattenInto(flat, *group);
  return absl::OkStatus();
}

absl::Status BroadcastBytes(Communicator& comm, int root, std::string* bytes,
                            const CollectiveOptions& options) {
  at::Tensor length = at::tensor({static_cast<int64_t>(bytes->size())},
                                 at::TensorOptions().dtype(at::kLong));
  CONCORD_RETURN_IF_ERROR(comm.Broadcast(length, root, options)->Wait());
  at::Tensor data =
      at::empty({length.item<int64_t>()}, at::TensorOptions().dtype(at::kByte));
  if (comm.rank() == root && !bytes->empty()) {
    std::memcpy(data.data_ptr(), bytes->data(), bytes->size());
  }
  CONCORD_RETURN_IF_ERROR(comm.Broadcast(data, root, options)->Wait());
  bytes->assign(static_cast<const char*>(data.data_ptr()),
                static_cast<size_t>(data.numel()));
  return absl::OkStatus();
}

namespace {

// Every rank's value's length (an int64 tensor of size() elements).
absl::StatusOr<at::Tensor> Lengths(Communicator& comm, const std::string& value,
                                   const CollectiveOptions& options) {
  const auto longs = at::TensorOptions().dtype(at::kLong);
  at::Tensor length = at::tensor({static_cast<int64_t>(value.size())}, longs);
  at::Tensor lengths = at::empty({comm.size()}, longs);
  CONCORD_RETURN_IF_ERROR(comm.Allgather(lengths, length, options)->Wait());
  return lengths;
}

// `value`'s bytes in a byte tensor of `size` (>= value.size()), zeros after.
at::Tensor Padded(const std::string& value, int64_t size) {
  at::Tensor out = at::zeros({size}, at::TensorOptions().dtype(at::kByte));
  if (!value.empty()) std::memcpy(out.data_ptr(), value.data(), value.size());
  return out;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> AllgatherStrings(
    Communicator& comm, const std::string& value,
    const CollectiveOptions& options) {
  const int world = comm.size();
  CONCORD_ASSIGN_OR_RETURN(const at::Tensor lengths,
                           Lengths(comm, value, options));
  const int64_t longest = lengths.max().item<int64_t>();
  at::Tensor mine = Padded(value, longest);
  at::Tensor all = at::empty({world * longest}, mine.options());
  CONCORD_RETURN_IF_ERROR(comm.Allgather(all, mine, options)->Wait());
  std::vector<std::string> out;
  const char* data = static_cast<const char*>(all.data_ptr());
  const int64_t* sizes = lengths.data_ptr<int64_t>();
  for (int r = 0; r < world; ++r) {
    out.emplace_back(data + r * longest, static_cast<size_t>(sizes[r]));
  }
  return out;
}

absl::StatusOr<std::vector<std::string>> GatherStrings(
    Communicator& comm, const std::string& value, const std::vector<int>& roots,
    const CollectiveOptions& options,
    const std::function<bool(int root, int rank)>& skip) {
  const int world = comm.size();
  const int me = comm.rank();
  for (int r : roots) {
    if (r < 0 || r >= world) {
      return absl::InvalidArgumentError(
          absl::StrCat("GatherStrings: root ", r, " of ", world, " ranks"));
    }
  }
  const bool root = std::find(roots.begin(), roots.end(), me) != roots.end();
  CONCORD_ASSIGN_OR_RETURN(const at::Tensor lengths,
                           Lengths(comm, value, options));
  const int64_t longest = lengths.max().item<int64_t>();
  const auto skips = [&skip](int to, int from) {
    return skip != nullptr && skip(to, from);
  };
  std::vector<int> to;
  for (int r : roots) {
    if (r != me && !skips(r, me)) to.push_back(r);
  }
  std::vector<int> from;
  std::vector<at::Tensor> recv;
  if (root) {
    for (int r = 0; r < world; ++r) {
      if (r == me || skips(me, r)) continue;
      from.push_back(r);
      recv.push_back(at::empty({longest}, at::kByte));
    }
  }
  if (longest > 0 && world > 1) {
    at::Tensor mine = Padded(value, longest);
    CONCORD_RETURN_IF_ERROR(
        comm.Exchange(mine, std::move(to), recv, from, options)->Wait());
  }
  std::vector<std::string> out;
  if (!root) return out;
  const int64_t* sizes = lengths.data_ptr<int64_t>();
  size_t next = 0;
  for (int r = 0; r < world; ++r) {
    if (r == me) {
      out.push_back(value);
      continue;
    }
    if (skips(me, r)) {
      out.emplace_back();
      continue;
    }
    const auto size = static_cast<size_t>(sizes[r]);
    out.emplace_back(
        size == 0 ? std::string()
                  : std::string(static_cast<const char*>(recv[next].data_ptr()),
                                size));
    ++next;
  }
  return out;
}

}  // namespace concord::comm
