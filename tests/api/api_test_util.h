#pragma once
// What the public API's single-process tests share (api_test.cc,
// api_checkpoint_test.cc): small modules and the one-line error check.

#include <concord/concord.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>

namespace concord_test {

struct NetImpl : torch::nn::Module {
  NetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(4, 8))),
        fc2(register_module("fc2", torch::nn::Linear(8, 1))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return fc2->forward(torch::relu(fc1->forward(x)));
  }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Net);

// A module whose forward takes two arguments: the holder forwards them.
struct TwoInputsImpl : torch::nn::Module {
  TwoInputsImpl() : fc(register_module("fc", torch::nn::Linear(2, 1))) {}
  torch::Tensor forward(const torch::Tensor& a, double scale) {
    return fc->forward(a) * scale;
  }
  torch::nn::Linear fc;
};
TORCH_MODULE(TwoInputs);

inline concord::ErrorCode CodeOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const concord::Error& e) {
    EXPECT_FALSE(e.message().empty());
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos)
        << "one line: " << e.what();
    return e.code();
  }
  ADD_FAILURE() << "no concord::Error thrown";
  return concord::ErrorCode::kUnknown;
}

}  // namespace concord_test
