#include "apps/mnist/idx.h"

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <system_error>

#include "pskv/error.h"

namespace pskv::mnist {
namespace {

constexpr std::uint32_t kImagesMagic = 0x00000803;  // unsigned byte, 3 dimensions
constexpr std::uint32_t kLabelsMagic = 0x00000801;  // unsigned byte, 1 dimension
constexpr std::string_view kFetchHint = "run scripts/fetch-data.sh to fetch fresh copies";
constexpr std::size_t kChunk = std::size_t{1} << 20;

[[noreturn]] void fail(Errc code, const std::string& path, const std::string& what,
                       std::string_view todo = kFetchHint) {
  throw Error(code, path + ": " + what + "; " + std::string(todo));
}

std::string hex32(std::uint32_t v) {
  char buf[11];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

std::uint32_t big_endian32(const unsigned char* p) {
  return std::uint32_t{p[0]} << 24 | std::uint32_t{p[1]} << 16 | std::uint32_t{p[2]} << 8 | std::uint32_t{p[3]};
}

// Reads an IDX file through zlib, which passes plain files through unchanged. The exact on-disk
// size is only meaningful for plain files; for gzip the check is on the decompressed stream.
// Thread-safety: one thread per reader.
class IdxReader {
 public:
  explicit IdxReader(const std::string& path) : path_(path) {
    std::error_code ec;
    const auto status = std::filesystem::status(path, ec);
    if (status.type() == std::filesystem::file_type::not_found)
      fail(Errc::io, path, "no such file", "check the path, or run scripts/fetch-data.sh to fetch the data");
    if (ec)
      fail(Errc::io, path, "cannot stat: " + ec.message(), "check the permissions of the file and its directories");
    if (!std::filesystem::is_regular_file(status))
      fail(Errc::io, path, "not a regular file", "pass the path of an IDX file");
    const auto size = std::filesystem::file_size(path, ec);
    if (ec) fail(Errc::io, path, "cannot stat: " + ec.message(), "check the file's permissions");
    file_size_ = size;
    compressed_ = starts_with_gzip_magic();
    file_ = gzopen(path.c_str(), "rb");
    if (file_ == nullptr)
      fail(Errc::io, path, std::string("cannot open: ") + std::strerror(errno), "check the file's permissions");
    gzbuffer(file_, 1 << 18);
  }
  ~IdxReader() { gzclose(file_); }
  IdxReader(const IdxReader&) = delete;
  IdxReader& operator=(const IdxReader&) = delete;

  bool compressed() const noexcept { return compressed_; }
  std::uint64_t file_size() const noexcept { return file_size_; }
  const std::string& path() const noexcept { return path_; }

  // Reads up to n bytes; returns fewer only at the end of the (decompressed) data.
  std::size_t read(void* out, std::size_t n) {
    auto* p = static_cast<unsigned char*>(out);
    std::size_t done = 0;
    while (done < n) {
      const auto want = static_cast<unsigned>(std::min<std::size_t>(n - done, INT_MAX / 2));
      const int got = gzread(file_, p + done, want);
      if (got < 0) corrupt();
      if (got == 0) break;
      done += static_cast<std::size_t>(got);
    }
    if (done < n) {
      // A stream cut short reports Z_BUF_ERROR here; the caller words the size mismatch.
      int err = Z_OK;
      gzerror(file_, &err);
      if (err != Z_OK && err != Z_BUF_ERROR) corrupt();
    }
    return done;
  }

  // Reads header bytes [from, to): the magic number first (to == 4), then the rest once the
  // magic has told which header this is.
  void read_header(unsigned char* header, std::size_t from, std::size_t to) {
    const std::size_t got = read(header + from, to - from);
    if (got < to - from)
      fail(Errc::invalid_argument, path_,
           "truncated: the data ends after " + std::to_string(from + got) + " bytes, inside the " +
               (to == 4 ? std::string("magic number") : std::to_string(to) + "-byte IDX header"));
  }

  // After the body: anything left over means the header undercounts the data. Reading on also
  // makes zlib verify the gzip trailer's CRC.
  void expect_end(std::uint64_t expected_bytes) {
    unsigned char extra = 0;
    if (read(&extra, 1) != 0) {
      if (!compressed_)
        fail(Errc::invalid_argument, path_,
             "size mismatch: the file has " + std::to_string(file_size_) + " bytes but its header describes " +
                 std::to_string(expected_bytes));
      fail(Errc::invalid_argument, path_,
           "size mismatch: decompresses to more than the " + std::to_string(expected_bytes) +
               " bytes its header describes");
    }
  }

 private:
  bool starts_with_gzip_magic() const {
    std::FILE* f = std::fopen(path_.c_str(), "rb");
    if (f == nullptr)
      fail(Errc::io, path_, std::string("cannot open: ") + std::strerror(errno), "check the file's permissions");
    std::array<unsigned char, 2> magic{};
    const bool gz = std::fread(magic.data(), 1, 2, f) == 2 && magic[0] == 0x1f && magic[1] == 0x8b;
    std::fclose(f);
    return gz;
  }

  [[noreturn]] void corrupt() {
    int err = Z_OK;
    const char* msg = gzerror(file_, &err);
    fail(err == Z_ERRNO ? Errc::io : Errc::invalid_argument, path_,
         std::string(compressed_ ? "corrupt gzip data: " : "read error: ") +
             (err == Z_ERRNO ? std::strerror(errno) : msg));
  }

  std::string path_;
  gzFile file_ = nullptr;
  std::uint64_t file_size_ = 0;
  bool compressed_ = false;
};

std::string magic_problem(std::uint32_t magic, std::uint32_t expected) {
  std::string what = "bad magic number " + hex32(magic) + " (expected " + hex32(expected) + ")";
  if (expected == kImagesMagic && magic == kLabelsMagic) what += ": this is a labels file, not an images file";
  if (expected == kLabelsMagic && magic == kImagesMagic) what += ": this is an images file, not a labels file";
  if ((magic >> 16) == 0x1f8b) what += ": gzip data that did not decompress";
  return what;
}

// The body must be exactly `expected` bytes. For a plain file that is known before reading, so
// a short or long file is reported with both sizes; for gzip it shows while decompressing.
void check_plain_size(const IdxReader& r, std::uint64_t header_bytes, std::uint64_t body_bytes,
                      const std::string& shape) {
  if (r.compressed()) return;
  const std::uint64_t expected = header_bytes + body_bytes;
  if (r.file_size() < expected)
    fail(Errc::invalid_argument, r.path(),
         "truncated: the file has " + std::to_string(r.file_size()) + " bytes but its header (" + shape + ") needs " +
             std::to_string(expected));
  if (r.file_size() > expected)
    fail(Errc::invalid_argument, r.path(),
         "size mismatch: the file has " + std::to_string(r.file_size()) + " bytes but its header (" + shape +
             ") describes " + std::to_string(expected));
}

[[noreturn]] void short_body(const IdxReader& r, std::uint64_t got, std::uint64_t expected, const std::string& shape) {
  fail(Errc::invalid_argument, r.path(),
       "truncated: decompresses to " + std::to_string(got) + " data bytes but its header (" + shape + ") needs " +
           std::to_string(expected));
}

struct Images {
  std::size_t n, rows, cols;
  std::vector<float> pixels;
};

Images read_images(const std::string& path) {
  IdxReader r(path);
  unsigned char h[16];
  r.read_header(h, 0, 4);
  const std::uint32_t magic = big_endian32(h);
  if (magic != kImagesMagic) fail(Errc::invalid_argument, path, magic_problem(magic, kImagesMagic));
  r.read_header(h, 4, 16);
  const std::uint64_t n = big_endian32(h + 4), rows = big_endian32(h + 8), cols = big_endian32(h + 12);
  const std::string shape = std::to_string(n) + " images of " + std::to_string(rows) + "x" + std::to_string(cols);
  if (n == 0 || rows == 0 || cols == 0)
    fail(Errc::invalid_argument, path, "empty data set in the header (" + shape + ")");
  // rows*cols < 2^64 always; n*rows*cols may not be, and no such file can exist.
  if (rows * cols > std::numeric_limits<std::uint64_t>::max() / n)
    fail(Errc::invalid_argument, path, "impossible dimensions in the header (" + shape + ")");
  const std::uint64_t body = n * rows * cols;
  check_plain_size(r, 16, body, shape);

  Images out{n, rows, cols, {}};
  if (!r.compressed()) out.pixels.reserve(body);
  std::vector<unsigned char> buf(kChunk);
  std::uint64_t done = 0;
  while (done < body) {
    const std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(kChunk, body - done));
    const std::size_t got = r.read(buf.data(), want);
    // Grow as data arrives, so a forged header in a small gzip file cannot make us allocate.
    const std::size_t old = out.pixels.size();
    out.pixels.resize(old + got);
    for (std::size_t i = 0; i < got; ++i) out.pixels[old + i] = static_cast<float>(buf[i]) * (1.0f / 255.0f);
    done += got;
    if (got < want) short_body(r, done, body, shape);
  }
  r.expect_end(body);
  return out;
}

std::vector<std::uint8_t> read_labels(const std::string& path) {
  IdxReader r(path);
  unsigned char h[8];
  r.read_header(h, 0, 4);
  const std::uint32_t magic = big_endian32(h);
  if (magic != kLabelsMagic) fail(Errc::invalid_argument, path, magic_problem(magic, kLabelsMagic));
  r.read_header(h, 4, 8);
  const std::uint64_t n = big_endian32(h + 4);
  const std::string shape = std::to_string(n) + " labels";
  if (n == 0) fail(Errc::invalid_argument, path, "empty data set in the header (0 labels)");
  check_plain_size(r, 8, n, shape);

  std::vector<std::uint8_t> labels;
  if (!r.compressed()) labels.reserve(n);
  std::uint64_t done = 0;
  while (done < n) {
    const std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(kChunk, n - done));
    const std::size_t old = labels.size();
    labels.resize(old + want);
    const std::size_t got = r.read(labels.data() + old, want);
    labels.resize(old + got);
    done += got;
    if (got < want) short_body(r, done, n, shape);
  }
  r.expect_end(n);
  for (std::size_t i = 0; i < labels.size(); ++i)
    if (labels[i] >= kNumClasses)
      fail(Errc::invalid_argument, path,
           "label " + std::to_string(labels[i]) + " at index " + std::to_string(i) +
               " is out of range (labels are 0..9): the file is not an MNIST-style labels file or is corrupt");
  return labels;
}

std::optional<std::string> find_file(const std::filesystem::path& dir, const std::string& name) {
  for (const auto& candidate : {dir / name, dir / (name + ".gz")}) {
    std::error_code ec;
    if (std::filesystem::exists(candidate, ec)) return candidate.string();
  }
  return std::nullopt;
}

}  // namespace

DatasetKind parse_dataset_kind(std::string_view name) {
  if (name == "mnist") return DatasetKind::mnist;
  if (name == "fashion") return DatasetKind::fashion;
  throw Error(Errc::invalid_argument, "unknown data set '" + std::string(name) + "': use 'mnist' or 'fashion'");
}

std::string_view to_string(DatasetKind kind) noexcept {
  return kind == DatasetKind::mnist ? "mnist" : "fashion";
}
std::string_view to_string(Split split) noexcept {
  return split == Split::train ? "train" : "test";
}

Dataset load_idx(const std::string& images_path, const std::string& labels_path) {
  Images images = read_images(images_path);
  std::vector<std::uint8_t> labels = read_labels(labels_path);
  if (labels.size() != images.n)
    throw Error(Errc::invalid_argument,
                images_path + " has " + std::to_string(images.n) + " images but " + labels_path + " has " +
                    std::to_string(labels.size()) +
                    " labels: the two files belong to different splits or data sets; pass a matching pair "
                    "(or run scripts/fetch-data.sh)");
  return Dataset{images.n, images.rows, images.cols, std::move(images.pixels), std::move(labels)};
}

Dataset load_dataset(const std::string& dir, Split split, DatasetKind kind) {
  const std::string prefix = split == Split::train ? "train" : "t10k";
  const std::string images_name = prefix + "-images-idx3-ubyte";
  const std::string labels_name = prefix + "-labels-idx1-ubyte";
  const std::filesystem::path root(dir);
  const std::filesystem::path sub = root / std::string(to_string(kind));
  std::optional<std::string> images = find_file(root, images_name);
  std::optional<std::string> labels = find_file(root, labels_name);
  if (!images || !labels) {
    images = find_file(sub, images_name);
    labels = find_file(sub, labels_name);
  }
  if (!images || !labels)
    throw Error(Errc::io, std::string(to_string(kind)) + " " + std::string(to_string(split)) +
                              " set not found: looked for " + images_name + "[.gz] and " + labels_name + "[.gz] in " +
                              root.string() + " and " + sub.string() +
                              "; run scripts/fetch-data.sh, or pass the directory that holds them");
  Dataset data = load_idx(*images, *labels);
  if (data.rows != kImageRows || data.cols != kImageCols)
    fail(Errc::invalid_argument, *images,
         "images are " + std::to_string(data.rows) + "x" + std::to_string(data.cols) +
             ", but MNIST and Fashion-MNIST images are 28x28: the file is from another data set");
  return data;
}

namespace {
Dataset slice(const Dataset& data, std::size_t begin, std::size_t end) {
  const std::size_t px = data.image_size();
  Dataset out{end - begin, data.rows, data.cols, {}, {}};
  out.images.assign(data.images.begin() + static_cast<std::ptrdiff_t>(begin * px),
                    data.images.begin() + static_cast<std::ptrdiff_t>(end * px));
  out.labels.assign(data.labels.begin() + static_cast<std::ptrdiff_t>(begin),
                    data.labels.begin() + static_cast<std::ptrdiff_t>(end));
  return out;
}
}  // namespace

Dataset shard(const Dataset& data, std::size_t worker, std::size_t num_workers) {
  if (num_workers == 0 || worker >= num_workers)
    throw Error(Errc::invalid_argument, "shard: worker " + std::to_string(worker) + " of " +
                                            std::to_string(num_workers) +
                                            " workers is not valid; worker ranks run 0..num_workers-1");
  if (data.n < num_workers)
    throw Error(Errc::invalid_argument, "shard: " + std::to_string(data.n) + " samples cannot be split over " +
                                            std::to_string(num_workers) + " workers; use fewer workers or more data");
  // n * w can exceed 64 bits when both are near 2^32 (IDX counts are 32-bit).
  const auto bound = [&](std::size_t w) {
    return static_cast<std::size_t>(static_cast<unsigned __int128>(data.n) * w / num_workers);
  };
  return slice(data, bound(worker), bound(worker + 1));
}

Dataset head(const Dataset& data, std::size_t n) {
  if (n == 0) throw Error(Errc::invalid_argument, "head: asked for 0 samples; ask for at least one");
  return slice(data, 0, std::min(n, data.n));
}

void gather(const Dataset& data, std::span<const std::uint32_t> indices, float* images_out, std::uint8_t* labels_out) {
  const std::size_t px = data.image_size();
  for (std::size_t i = 0; i < indices.size(); ++i) {
    const std::size_t j = indices[i];
    if (j >= data.n)
      throw Error(Errc::invalid_argument, "gather: index " + std::to_string(j) + " is out of range for a data set of " +
                                              std::to_string(data.n) + " samples; draw indices from 0..n-1");
    std::memcpy(images_out + i * px, data.images.data() + j * px, px * sizeof(float));
    labels_out[i] = data.labels[j];
  }
}

}  // namespace pskv::mnist
