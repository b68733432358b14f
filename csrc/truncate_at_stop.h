// Shared declarations for the truncate_at_stop op (CPU and CUDA halves).
#pragma once
#include <ATen/ATen.h>

#include <tuple>

namespace fastppo {

// Validates arguments (TORCH_CHECK, naming the argument) and allocates the four
// outputs; both device implementations call it so the checks live in one place.
struct TruncateOutputs {
  at::Tensor truncated;  // [B, T], dtype of responses
  at::Tensor lengths;    // [B] int64
  at::Tensor mask;       // [B, T] bool
  at::Tensor has_stop;   // [B] bool
};

TruncateOutputs check_and_allocate(const at::Tensor& responses, const at::Tensor& stop_ids, int64_t pad_id);

}  // namespace fastppo
