#include "apps/mnist/idx.h"

#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>

#include "pskv/error.h"
#include "support/errors.h"

namespace pskv::mnist {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<unsigned char>;

void put32(Bytes& b, std::uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) b.push_back(static_cast<unsigned char>(v >> shift));
}

Bytes images_file(std::uint32_t n, std::uint32_t rows, std::uint32_t cols, std::uint32_t magic = 0x803) {
  Bytes b;
  put32(b, magic);
  put32(b, n);
  put32(b, rows);
  put32(b, cols);
  for (std::uint32_t i = 0; i < n * rows * cols; ++i) b.push_back(static_cast<unsigned char>(i * 7 % 256));
  return b;
}

Bytes labels_file(std::initializer_list<unsigned char> labels) {
  Bytes b;
  put32(b, 0x801);
  put32(b, static_cast<std::uint32_t>(labels.size()));
  b.insert(b.end(), labels);
  return b;
}

class IdxTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("pskv-idx-" + std::to_string(::getpid()) + "-" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& name, const Bytes& bytes, bool gzip = false) {
    const std::string path = (dir_ / name).string();
    fs::create_directories(fs::path(path).parent_path());
    if (gzip) {
      gzFile f = gzopen(path.c_str(), "wb");
      EXPECT_NE(f, nullptr);
      EXPECT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
      EXPECT_EQ(gzclose(f), Z_OK);
    } else {
      std::ofstream(path, std::ios::binary)
          .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    }
    return path;
  }

  fs::path dir_;
};

using pskv::testing::expect_error;

void expect_matches(const Dataset& d, std::uint32_t n, std::uint32_t rows, std::uint32_t cols, const Bytes& labels) {
  ASSERT_EQ(d.n, n);
  EXPECT_EQ(d.rows, rows);
  EXPECT_EQ(d.cols, cols);
  ASSERT_EQ(d.images.size(), std::size_t{n} * rows * cols);
  for (std::uint32_t i = 0; i < n * rows * cols; ++i)
    EXPECT_FLOAT_EQ(d.images[i], static_cast<float>(i * 7 % 256) / 255.0f);
  EXPECT_EQ(d.labels, std::vector<std::uint8_t>(labels.end() - n, labels.end()));
}

TEST_F(IdxTest, RoundTripPlain) {
  const Bytes labels = labels_file({3, 0, 9});
  const Dataset d = load_idx(write("i", images_file(3, 4, 5)), write("l", labels));
  expect_matches(d, 3, 4, 5, labels);
  EXPECT_FLOAT_EQ(d.image(2)[0], static_cast<float>(40 * 7 % 256) / 255.0f);
}

TEST_F(IdxTest, RoundTripGzipDetectedByContentNotName) {
  const Bytes labels = labels_file({1, 2, 3, 4, 5, 6, 7});
  // A large enough image set that decompression spans several zlib buffers and our read chunks.
  const Dataset d = load_idx(write("i", images_file(7, 300, 700), true), write("l.gz", labels, true));
  expect_matches(d, 7, 300, 700, labels);
  const Dataset mixed = load_idx(write("i2.gz", images_file(7, 3, 3), true), write("l2", labels));
  expect_matches(mixed, 7, 3, 3, labels);
}

TEST_F(IdxTest, LoadDatasetFindsStandardNames) {
  write("mnist/train-images-idx3-ubyte", images_file(2, 28, 28));
  write("mnist/train-labels-idx1-ubyte.gz", labels_file({4, 2}), true);
  write("mnist/t10k-images-idx3-ubyte.gz", images_file(1, 28, 28), true);
  write("mnist/t10k-labels-idx1-ubyte", labels_file({8}));
  // Both the data root and the data set's own folder work.
  for (const fs::path& dir : {dir_, dir_ / "mnist"}) {
    const Dataset train = load_dataset(dir.string(), Split::train, DatasetKind::mnist);
    EXPECT_EQ(train.n, 2u);
    EXPECT_EQ(train.labels, (std::vector<std::uint8_t>{4, 2}));
    const Dataset test = load_dataset(dir.string(), Split::test, DatasetKind::mnist);
    EXPECT_EQ(test.n, 1u);
    EXPECT_EQ(test.labels[0], 8);
  }
  expect_error([&] { load_dataset(dir_.string(), Split::train, DatasetKind::fashion); }, Errc::io,
               {"fashion train set not found", "train-images-idx3-ubyte[.gz]", (dir_ / "fashion").string(),
                "scripts/fetch-data.sh"});
}

TEST_F(IdxTest, LoadDatasetWantsTwentyEightByTwentyEight) {
  write("train-images-idx3-ubyte", images_file(2, 4, 4));
  write("train-labels-idx1-ubyte", labels_file({4, 2}));
  expect_error([&] { load_dataset(dir_.string(), Split::train, DatasetKind::mnist); }, Errc::invalid_argument,
               {"train-images-idx3-ubyte", "4x4", "28x28"});
}

TEST_F(IdxTest, WrongMagic) {
  const std::string labels = write("l", labels_file({1}));
  const std::string images = write("i", images_file(1, 2, 2));
  expect_error([&] { load_idx(labels, labels); }, Errc::invalid_argument,
               {labels, "bad magic number 0x00000801", "expected 0x00000803", "labels file, not an images file",
                "scripts/fetch-data.sh"});
  expect_error([&] { load_idx(images, images); }, Errc::invalid_argument,
               {images, "bad magic number 0x00000803", "images file, not a labels file"});
  const std::string html = write("html", Bytes{'<', 'h', 't', 'm', 'l', '>', '\n', '\n'});
  expect_error([&] { load_idx(html, labels); }, Errc::invalid_argument, {html, "bad magic number 0x3c68746d"});
}

TEST_F(IdxTest, TruncatedHeader) {
  const std::string p = write("i", Bytes{0, 0, 8});
  expect_error([&] { load_idx(p, p); }, Errc::invalid_argument,
               {p, "truncated", "ends after 3 bytes", "inside the magic number"});
  Bytes header_only = images_file(1, 2, 2);
  header_only.resize(10);
  const std::string q = write("j", header_only);
  expect_error([&] { load_idx(q, q); }, Errc::invalid_argument,
               {q, "truncated", "ends after 10 bytes", "inside the 16-byte IDX header"});
}

TEST_F(IdxTest, TruncatedBody) {
  Bytes img = images_file(3, 4, 4);
  img.resize(img.size() - 5);
  const std::string labels = write("l", labels_file({1, 2, 3}));
  const std::string plain = write("i", img);
  expect_error([&] { load_idx(plain, labels); }, Errc::invalid_argument,
               {plain, "truncated", "has 59 bytes", "3 images of 4x4", "needs 64", "scripts/fetch-data.sh"});
  const std::string gz = write("i.gz", img, true);
  expect_error([&] { load_idx(gz, labels); }, Errc::invalid_argument,
               {gz, "truncated", "decompresses to 43 data bytes", "needs 48"});
  Bytes lab = labels_file({1, 2, 3});
  lab.pop_back();
  const std::string short_labels = write("l2", lab);
  expect_error([&] { load_idx(write("i2", images_file(3, 4, 4)), short_labels); }, Errc::invalid_argument,
               {short_labels, "truncated", "3 labels"});
}

TEST_F(IdxTest, CutGzipStream) {
  const std::string labels = write("l", labels_file({1, 2, 3}));
  const std::string gz = write("i.gz", images_file(3, 100, 100), true);
  fs::resize_file(gz, fs::file_size(gz) / 2);
  try {
    load_idx(gz, labels);
    ADD_FAILURE() << "no exception";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_NE(std::string(e.what()).find(gz), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("fetch-data.sh"), std::string::npos) << e.what();
  }
}

TEST_F(IdxTest, CorruptGzipChecksum) {
  const std::string labels = write("l", labels_file({1, 2, 3}));
  const std::string gz = write("i.gz", images_file(3, 10, 10), true);
  std::fstream f(gz, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(-8, std::ios::end);  // the CRC-32 in the gzip trailer
  f.put('\x5a');
  f.close();
  expect_error([&] { load_idx(gz, labels); }, Errc::invalid_argument, {gz, "corrupt gzip data"});
}

TEST_F(IdxTest, SizeMismatchExtraBytes) {
  Bytes img = images_file(2, 3, 3);
  img.push_back(0);
  img.push_back(0);
  const std::string labels = write("l", labels_file({1, 2}));
  const std::string plain = write("i", img);
  expect_error([&] { load_idx(plain, labels); }, Errc::invalid_argument,
               {plain, "size mismatch", "has 36 bytes", "2 images of 3x3", "describes 34"});
  const std::string gz = write("i.gz", img, true);
  expect_error([&] { load_idx(gz, labels); }, Errc::invalid_argument, {gz, "size mismatch", "more than the 18 bytes"});
}

TEST_F(IdxTest, ImpossibleHeaders) {
  const std::string labels = write("l", labels_file({1}));
  const std::string empty = write("e", images_file(0, 28, 28));
  expect_error([&] { load_idx(empty, labels); }, Errc::invalid_argument, {empty, "empty data set", "0 images"});
  // A forged count in a small gzip file fails as truncated without allocating the claimed size.
  Bytes forged = images_file(1, 28, 28);
  forged[4] = 0xff;
  const std::string gz = write("f.gz", forged, true);
  expect_error([&] { load_idx(gz, labels); }, Errc::invalid_argument, {gz, "truncated", "4278190081 images"});
}

TEST_F(IdxTest, LabelOutOfRange) {
  const std::string labels = write("l", labels_file({1, 12, 3}));
  expect_error([&] { load_idx(write("i", images_file(3, 2, 2)), labels); }, Errc::invalid_argument,
               {labels, "label 12 at index 1", "0..9"});
}

TEST_F(IdxTest, CountMismatch) {
  const std::string images = write("i", images_file(3, 2, 2));
  const std::string labels = write("l", labels_file({1, 2}));
  expect_error([&] { load_idx(images, labels); }, Errc::invalid_argument,
               {images + " has 3 images", labels + " has 2 labels", "different splits"});
}

TEST_F(IdxTest, MissingFileAndDirectory) {
  const std::string labels = write("l", labels_file({1}));
  const std::string missing = (dir_ / "nope").string();
  expect_error([&] { load_idx(missing, labels); }, Errc::io, {missing, "no such file", "scripts/fetch-data.sh"});
  expect_error([&] { load_idx(dir_.string(), labels); }, Errc::io, {dir_.string(), "not a regular file"});
}

Dataset numbered(std::size_t n) {
  Dataset d{n, 1, 2, {}, {}};
  for (std::size_t i = 0; i < n; ++i) {
    d.images.push_back(static_cast<float>(i));
    d.images.push_back(-static_cast<float>(i));
    d.labels.push_back(static_cast<std::uint8_t>(i % 10));
  }
  return d;
}

TEST(Slicing, ShardIsContiguousDisjointAndCovering) {
  const Dataset d = numbered(10);
  std::size_t next = 0;
  for (std::size_t w = 0; w < 3; ++w) {
    const Dataset s = shard(d, w, 3);
    EXPECT_TRUE(s.n == 3 || s.n == 4);
    ASSERT_EQ(s.images.size(), s.n * 2);
    ASSERT_EQ(s.labels.size(), s.n);
    for (std::size_t i = 0; i < s.n; ++i, ++next) {
      EXPECT_EQ(s.image(i)[0], static_cast<float>(next));
      EXPECT_EQ(s.labels[i], next % 10);
    }
  }
  EXPECT_EQ(next, 10u);
  EXPECT_EQ(shard(d, 0, 1).images, d.images);
}

TEST(Slicing, ShardRejectsBadRanks) {
  const Dataset d = numbered(4);
  expect_error([&] { shard(d, 3, 3); }, Errc::invalid_argument, {"worker 3 of 3", "0..num_workers-1"});
  expect_error([&] { shard(d, 0, 0); }, Errc::invalid_argument, {"worker 0 of 0"});
  expect_error([&] { shard(d, 0, 5); }, Errc::invalid_argument, {"4 samples cannot be split over 5 workers"});
}

TEST(Slicing, HeadClampsAndRejectsZero) {
  const Dataset d = numbered(5);
  const Dataset h = head(d, 2);
  EXPECT_EQ(h.n, 2u);
  EXPECT_EQ(h.images, (std::vector<float>{0, -0.0f, 1, -1}));
  EXPECT_EQ(head(d, 50).n, 5u);
  expect_error([&] { head(d, 0); }, Errc::invalid_argument, {"at least one"});
}

TEST(Slicing, GatherCopiesSelectedSamples) {
  const Dataset d = numbered(5);
  const std::vector<std::uint32_t> idx{4, 0, 4};
  std::vector<float> img(6);
  std::vector<std::uint8_t> lab(3);
  gather(d, idx, img.data(), lab.data());
  EXPECT_EQ(img, (std::vector<float>{4, -4, 0, 0, 4, -4}));
  EXPECT_EQ(lab, (std::vector<std::uint8_t>{4, 0, 4}));
  const std::vector<std::uint32_t> bad{1, 5};
  expect_error([&] { gather(d, bad, img.data(), lab.data()); }, Errc::invalid_argument, {"index 5", "5 samples"});
}

TEST(Names, DatasetKind) {
  EXPECT_EQ(parse_dataset_kind("mnist"), DatasetKind::mnist);
  EXPECT_EQ(parse_dataset_kind("fashion"), DatasetKind::fashion);
  EXPECT_EQ(to_string(DatasetKind::fashion), "fashion");
  EXPECT_EQ(to_string(Split::test), "test");
  expect_error([] { parse_dataset_kind("cifar"); }, Errc::invalid_argument, {"'cifar'", "'mnist' or 'fashion'"});
}

}  // namespace
}  // namespace pskv::mnist
