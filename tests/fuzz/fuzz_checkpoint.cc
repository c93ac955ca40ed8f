// The checkpoint reader: first as a validator, then restoring into a small real store and the
// pending steps of 2 sync workers.
#include <cstddef>
#include <cstdint>

#include "server/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace pskv;
  try {
    parse_checkpoint(data, size, nullptr, nullptr, "fuzz");
  } catch (const Error&) {
    return 0;
  }
  StoreOptions o;
  o.max_keys = 256;
  o.arena_bytes = 1 << 20;
  o.rule.rule = UpdateRule::momentum;
  auto store = Store::create(std::make_unique<HeapMemory>(Store::required_bytes(o)), o);
  SyncOptions so;
  so.num_workers = 2;
  SyncAccumulator sync(*store, so);
  try {
    parse_checkpoint(data, size, store.get(), &sync, "fuzz");
  } catch (const Error&) {
  }
  return 0;
}
