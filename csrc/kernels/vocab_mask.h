#pragma once
#include <cstdint>

#include "kernels/host_device.h"

namespace megatron_ext::kernels {

// A token id seen by the rank that holds vocabulary rows [first, last): the local row it reads
// (0 when the id belongs to another rank) and whether it belongs to another rank.
MEGATRON_EXT_HOST_DEVICE void vocab_mask_one(int64_t id, int64_t first, int64_t last,
                                             int64_t* local_id, bool* outside) {
  const bool out = id < first || id >= last;
  *outside = out;
  *local_id = out ? 0 : id - first;
}

}  // namespace megatron_ext::kernels
