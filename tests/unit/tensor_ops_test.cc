// worker/tensor_ops.h (see Note [Kernels in the worker]): the kernels' CPU
// twins behind LibTorch tensors must do exactly what the LibTorch ops they
// replace do — at::cat of the reshaped tensors, Tensor::copy_, Tensor::to, mul_
// — bit for bit, for every layout and dtype, including the ones that fall back.
#include "worker/tensor_ops.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>
#include <vector>

namespace concord {
namespace {

// Bitwise (signed zeros count), except that a NaN equals any NaN: LibTorch's
// own float -> bfloat16 cast writes 0xFFFF from its vectorised loop and
// 0x7FC0 (what the kernels write, as c10::BFloat16 does) from its scalar one.
bool Identical(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || !a.sizes().equals(b.sizes())) {
    return false;
  }
  auto ac = a.contiguous(), bc = b.contiguous();
  if (ac.is_floating_point()) {
    const auto both_nan = torch::logical_and(ac.isnan(), bc.isnan());
    ac = ac.masked_fill(both_nan, 0);
    bc = bc.masked_fill(both_nan, 0);
  }
  return std::memcmp(ac.data_ptr(), bc.data_ptr(), ac.nbytes()) == 0;
}

torch::Tensor Cat(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> flat;
  for (const auto& t : tensors) flat.push_back(t.reshape({-1}));
  return torch::cat(flat);
}

// Tensors of one dtype in every layout the reducer and SlowMo meet:
// contiguous, transposed, channels-last, a slice, empty, a scalar.
std::vector<torch::Tensor> Mixed(torch::ScalarType dtype, int seed) {
  torch::manual_seed(seed);
  auto opts = torch::TensorOptions().dtype(torch::kFloat);
  std::vector<torch::Tensor> out = {
      torch::randn({3, 5}, opts),
      torch::randn({4, 3}, opts).t(),
      torch::randn({2, 3, 4, 5}, opts)
          .contiguous(torch::MemoryFormat::ChannelsLast),
      torch::randn({0, 7}, opts),
      torch::randn({}, opts),
      torch::randn({11, 2}, opts).narrow(1, 1, 1),
      torch::randn({17}, opts)};
  for (auto& t : out) t = (t * 100).to(dtype);
  return out;
}

TEST(TensorOpsTest, FlattenEqualsCatForEveryLayoutAndDtype) {
  for (auto dtype : {torch::kFloat, torch::kDouble, torch::kHalf,
                     torch::kBFloat16, torch::kLong, torch::kByte}) {
    const auto tensors = Mixed(dtype, 1);
    const torch::Tensor flat = FlattenTensors(tensors);
    EXPECT_TRUE(Identical(flat, Cat(tensors))) << dtype;
    EXPECT_TRUE(flat.is_contiguous());
  }
  // Mixed dtypes take at::cat's promotion.
  std::vector<torch::Tensor> mixed = {torch::ones({2}, torch::kHalf),
                                      torch::full({3}, 2.5, torch::kDouble)};
  EXPECT_TRUE(Identical(FlattenTensors(mixed), Cat(mixed)));
  EXPECT_EQ(FlattenTensors({}).numel(), 0);
}

TEST(TensorOpsTest, FlattenOfParametersIsACopyOutsideTheGraph) {
  torch::Tensor p = torch::randn({4, 4}, torch::requires_grad());
  const torch::Tensor flat = FlattenTensors({p});
  EXPECT_FALSE(flat.requires_grad());
  flat.fill_(0);
  EXPECT_NE(p.abs().sum().item<float>(), 0.0f);
}

TEST(TensorOpsTest, UnflattenIntoEqualsCopyIntoEveryLayout) {
  for (auto dtype : {torch::kFloat, torch::kHalf, torch::kDouble}) {
    auto targets = Mixed(dtype, 2);
    auto expected = Mixed(dtype, 2);
    torch::manual_seed(3);
    const int64_t offset = 5;
    int64_t total = offset;
    for (const auto& t : targets) total += t.numel();
    const torch::Tensor flat = (torch::randn({total}) * 7).to(dtype);
    std::vector<int64_t> versions;
    for (const auto& t : targets) versions.push_back(t._version());

    UnflattenInto(flat, targets, offset);
    int64_t at = offset;
    for (size_t k = 0; k < targets.size(); ++k) {
      auto& e = expected[k];
      e.copy_(flat.narrow(0, at, e.numel()).view(e.sizes()));
      at += e.numel();
      EXPECT_TRUE(Identical(targets[k], e)) << dtype << " tensor " << k;
      // Strides are kept: the user's tensor is written in place.
      EXPECT_EQ(targets[k].strides(), e.strides());
      if (targets[k].numel() > 0) {
        EXPECT_GT(targets[k]._version(), versions[k]) << "tensor " << k;
      }
    }
  }
}

TEST(TensorOpsTest, UnflattenIntoCastsLikeCopyWhenTheDtypesDiffer) {
  const torch::Tensor flat = torch::randn({12}) * 1000;
  torch::Tensor half = torch::empty({3, 4}, torch::kHalf);
  torch::Tensor bf16 = torch::empty({12}, torch::kBFloat16);
  UnflattenInto(flat, std::vector<FlatPiece>{{half, 0}, {bf16, 0}});
  EXPECT_TRUE(Identical(half, flat.view({3, 4}).to(torch::kHalf)));
  EXPECT_TRUE(Identical(bf16, flat.to(torch::kBFloat16)));
}

TEST(TensorOpsTest, UnflattenIntoAPieceOutsideChangesNothing) {
  const torch::Tensor flat = torch::arange(10, torch::kFloat);
  torch::Tensor a = torch::zeros({4});
  torch::Tensor strided = torch::zeros({4, 2}).t();  // copied with copy_
  torch::Tensor late = torch::zeros({3});
  EXPECT_THROW(
      UnflattenInto(flat,
                    std::vector<FlatPiece>{{a, 0}, {strided, 0}, {late, 8}}),
      c10::Error);
  EXPECT_EQ(a.abs().sum().item<float>(), 0.0f);
  EXPECT_EQ(strided.abs().sum().item<float>(), 0.0f);
  EXPECT_EQ(late.abs().sum().item<float>(), 0.0f);
  EXPECT_THROW(UnflattenInto(flat, std::vector<FlatPiece>{{a, -1}}),
               c10::Error);
}

// Values where rounding goes wrong first: ties, subnormals of both narrow
// types, overflow to infinity, NaN, signed zeros.
torch::Tensor Awkward() {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> v = {0.0f,           -0.0f,    1.0f,     1.0f + 0x1p-11f,
                          1.0f + 0x1p-8f, 65504.0f, 65519.0f, 65520.0f,
                          1e6f,           -1e6f,    6e-8f,    3e-8f,
                          1e-40f,         -1e-45f,  inf,      -inf,
                          std::nanf(""),  3.4e38f,  0.1f,     -2.71828f};
  torch::Tensor t = torch::tensor(v);
  torch::manual_seed(4);
  return torch::cat(
      {t, torch::randn({1001}) * 300, torch::randn({257}) * 1e-6});
}

TEST(TensorOpsTest, CastToRoundsLikeTensorTo) {
  const torch::Tensor x = Awkward();
  for (auto to : {torch::kHalf, torch::kBFloat16, torch::kFloat}) {
    const torch::Tensor got = CastTo(x, to);
    EXPECT_TRUE(Identical(got, x.to(to))) << to;
    EXPECT_FALSE(got.is_alias_of(x)) << "a cast is a new tensor";
  }
  const torch::Tensor half = x.to(torch::kHalf);
  EXPECT_TRUE(Identical(CastTo(half, torch::kFloat), half.to(torch::kFloat)));
  EXPECT_TRUE(
      Identical(CastTo(half, torch::kBFloat16), half.to(torch::kBFloat16)));
  // Beyond the kernels' types: Tensor::to itself.
  const torch::Tensor dbl = x.to(torch::kDouble);
  EXPECT_TRUE(Identical(CastTo(dbl, torch::kHalf), dbl.to(torch::kHalf)));
  EXPECT_TRUE(Identical(CastTo(x, torch::kDouble), dbl));
  // Shape and a non-contiguous source.
  const torch::Tensor m = torch::randn({6, 5}).t();
  EXPECT_TRUE(Identical(CastTo(m, torch::kHalf), m.to(torch::kHalf)));
  EXPECT_EQ(CastTo(m, torch::kHalf).sizes(), m.sizes());
}

TEST(TensorOpsTest, CastIntoEqualsCopy) {
  const torch::Tensor x = Awkward().to(torch::kHalf);
  torch::Tensor got = torch::empty(x.sizes(), torch::kFloat);
  const int64_t before = got._version();
  CastInto(x, got);
  EXPECT_TRUE(Identical(got, x.to(torch::kFloat)));
  EXPECT_GT(got._version(), before);
  // A strided destination goes through copy_.
  torch::Tensor strided = torch::empty({5, 6}, torch::kBFloat16).t();
  const torch::Tensor src = torch::randn({6, 5});
  CastInto(src, strided);
  EXPECT_TRUE(Identical(strided, src.to(torch::kBFloat16)));
}

TEST(TensorOpsTest, ScaleEqualsMulBitForBit) {
  for (double factor : {1.0 / 3, 1.0 / 7, 0.1, 2.0, 1.0 / 65536, -0.5}) {
    const torch::Tensor x = Awkward();
    torch::Tensor got = x.clone();
    Scale(got, factor);
    EXPECT_TRUE(Identical(got, x.clone().mul_(factor))) << factor;
    for (auto dtype : {torch::kDouble, torch::kHalf, torch::kBFloat16}) {
      torch::Tensor y = x.to(dtype);
      torch::Tensor expected = y.clone().mul_(factor);
      Scale(y, factor);
      EXPECT_TRUE(Identical(y, expected)) << dtype << " " << factor;
    }
    torch::Tensor strided = torch::randn({7, 9}).t();
    torch::Tensor expected = strided.clone().mul_(factor);
    Scale(strided, factor);
    EXPECT_TRUE(Identical(strided, expected));
  }
}

}  // namespace
}  // namespace concord
