// The table checkpoint reader: first as a validator, then restoring into a real table made from
// the spec the file names.
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "server/table_checkpoint.h"
#include "table/embedding_table.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace pskv;
  TableSpec spec;
  try {
    TableCheckpointer::apply(data, size, 0, 0, 1, 0, &spec, nullptr, "fuzz");
  } catch (const Error&) {
    return 0;
  }
  spec.max_rows = std::min<std::uint64_t>(spec.max_rows, 1u << 16);  // the file's own cap, bounded for the fuzzer
  EmbeddingTable table(spec);
  try {
    TableCheckpointer::apply(data, size, 0, 0, 1, 0, &spec, &table, "fuzz");
  } catch (const Error&) {
  }
  return 0;
}
