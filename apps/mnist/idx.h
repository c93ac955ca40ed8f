// MNIST / Fashion-MNIST data: the IDX file format (plain or gzip-compressed), the standard file
// names, and the slicing a data-parallel trainer needs (one contiguous shard per worker).
//
// Every loader validates the whole file before returning: magic number, dimensions, that the
// size matches the header exactly, label range, and that images and labels agree in count.
// Failures throw pskv::Error naming the file, the fault, and what to do.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace pskv::mnist {

inline constexpr std::size_t kImageRows = 28;
inline constexpr std::size_t kImageCols = 28;
inline constexpr std::size_t kImageSize = kImageRows * kImageCols;
inline constexpr std::size_t kNumClasses = 10;

enum class Split { train, test };
enum class DatasetKind { mnist, fashion };

// "mnist" | "fashion"; anything else throws Errc::invalid_argument.
DatasetKind parse_dataset_kind(std::string_view name);
std::string_view to_string(DatasetKind kind) noexcept;
std::string_view to_string(Split split) noexcept;

// Images row-major, one after another, pixels scaled from [0,255] to [0,1].
// Thread-safety: a plain value; concurrent reads are safe.
struct Dataset {
  std::size_t n = 0;
  std::size_t rows = 0;
  std::size_t cols = 0;
  std::vector<float> images;         // n * rows * cols
  std::vector<std::uint8_t> labels;  // n, each < kNumClasses

  std::size_t image_size() const noexcept { return rows * cols; }
  const float* image(std::size_t i) const noexcept { return images.data() + i * image_size(); }
};

// Loads one images file (magic 0x00000803) and one labels file (magic 0x00000801). Each may be
// gzip-compressed; that is detected from the content, not the name. Any image size is accepted.
Dataset load_idx(const std::string& images_path, const std::string& labels_path);

// Finds the split's files by their standard names (train-images-idx3-ubyte,
// t10k-labels-idx1-ubyte, ... each with or without .gz) in `dir`, or else in `dir`/mnist or
// `dir`/fashion by `kind` -- so both the data root that scripts/fetch-data.sh fills and the
// dataset's own folder work. Requires 28x28 images.
Dataset load_dataset(const std::string& dir, Split split, DatasetKind kind);

// Worker `worker` of `num_workers` gets samples [n*w/W, n*(w+1)/W): contiguous, disjoint,
// covering everything, sizes differing by at most one. Throws if a shard would be empty.
Dataset shard(const Dataset& data, std::size_t worker, std::size_t num_workers);

// The first min(n, data.n) samples, for short runs. n must be > 0.
Dataset head(const Dataset& data, std::size_t n);

// Copies the samples at `indices` into contiguous buffers (indices.size() images and labels),
// which is how a trainer feeds a shuffled mini-batch to Model::forward_backward.
void gather(const Dataset& data, std::span<const std::uint32_t> indices, float* images_out, std::uint8_t* labels_out);

}  // namespace pskv::mnist
