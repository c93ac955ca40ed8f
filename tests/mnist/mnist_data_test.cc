// Tests on the real data sets, which scripts/fetch-data.sh puts in <repo>/data (or
// $PSKV_DATA_DIR). Each test skips, saying so, when its data set is absent.
#include <gtest/gtest.h>

#include <array>
#include <cstdlib>
#include <filesystem>
#include <numeric>

#include "apps/mnist/idx.h"
#include "apps/mnist/model.h"

namespace pskv::mnist {
namespace {

std::string data_dir() {
  const char* env = std::getenv("PSKV_DATA_DIR");
  return env != nullptr && *env != '\0' ? env : PSKV_DEFAULT_DATA_DIR;
}

bool present(DatasetKind kind) {
  const auto dir = std::filesystem::path(data_dir()) / std::string(to_string(kind));
  return std::filesystem::exists(dir / "train-images-idx3-ubyte") ||
         std::filesystem::exists(dir / "train-images-idx3-ubyte.gz");
}

#define SKIP_WITHOUT(kind)                                                  \
  if (!present(kind))                                                       \
  GTEST_SKIP() << to_string(kind) << " data not found under " << data_dir() \
               << " (run scripts/fetch-data.sh, or set PSKV_DATA_DIR); skipping the real-data test"

void expect_standard_shapes(DatasetKind kind) {
  const Dataset train = load_dataset(data_dir(), Split::train, kind);
  const Dataset test = load_dataset(data_dir(), Split::test, kind);
  EXPECT_EQ(train.n, 60000u);
  EXPECT_EQ(test.n, 10000u);
  EXPECT_EQ(train.rows, 28u);
  EXPECT_EQ(test.cols, 28u);
  // Every class is well represented.
  std::array<std::size_t, kNumClasses> counts{};
  for (auto l : train.labels) ++counts[l];
  for (auto c : counts) EXPECT_GT(c, 5000u);
}

TEST(RealData, MnistLoads) {
  SKIP_WITHOUT(DatasetKind::mnist);
  expect_standard_shapes(DatasetKind::mnist);
}

TEST(RealData, FashionMnistLoads) {
  SKIP_WITHOUT(DatasetKind::fashion);
  expect_standard_shapes(DatasetKind::fashion);
}

TEST(RealData, MlpSgdOnASliceOfMnist) {
  SKIP_WITHOUT(DatasetKind::mnist);
  const Dataset train = head(load_dataset(data_dir(), Split::train, DatasetKind::mnist), 8000);
  const Dataset test = head(load_dataset(data_dir(), Split::test, DatasetKind::mnist), 2000);
  auto model = make_model("mlp", 1);
  model->init(1);
  const std::size_t batch = 32;
  std::vector<float> losses;
  for (std::size_t at = 0; at + batch <= train.n; at += batch)
    losses.push_back(sgd_step(*model, train.image(at), train.labels.data() + at, batch, 0.1f));
  const auto mean = [&](std::size_t from, std::size_t to) {
    return std::accumulate(losses.begin() + static_cast<std::ptrdiff_t>(from),
                           losses.begin() + static_cast<std::ptrdiff_t>(to), 0.0) /
           static_cast<double>(to - from);
  };
  EXPECT_LT(mean(losses.size() - 20, losses.size()), 0.25 * mean(0, 20));
  // One pass over 8000 images: a healthy MLP is well past 85% here.
  const double accuracy = static_cast<double>(model->count_correct(test.images.data(), test.labels.data(), test.n)) /
                          static_cast<double>(test.n);
  std::printf("MLP, one pass over 8000 MNIST images: test accuracy %.3f\n", accuracy);
  EXPECT_GT(accuracy, 0.85);
}

}  // namespace
}  // namespace pskv::mnist
