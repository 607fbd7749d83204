#include "worker/ddp/manual_reducer.h"

#include <ATen/ATen.h>

#include <map>

#include "worker/tensor_ops.h"

namespace concord::ddp {

absl::Status ManualReducer::Reduce() {
  at::NoGradGuard no_grad;
  std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (const auto& p : params_) {
    if (p.grad().defined())
      by_dtype[p.grad().scalar_type()].push_back(p.grad());
  }
  std::vector<std::pair<at::Tensor, std::vector<at::Tensor>*>> flats;
  std::vector<std::shared_ptr<comm::Work>> works;
  for (auto& [dtype, grads] : by_dtype) {
    at::Tensor flat = FlattenTensors(grads);
    works.push_back(comm_->AllreduceSum(flat, options_));
    flats.emplace_back(flat, &grads);
  }
  for (auto& w : works) {
    if (absl::Status s = w->Wait(); !s.ok()) return s;
  }
  const double world = static_cast<double>(comm_->size());
  for (auto& [flat, grads] : flats) {
    flat.div_(world);
    UnflattenInto(flat, *grads);
  }
  return absl::OkStatus();
}

}  // namespace concord::ddp
