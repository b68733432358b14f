// truncate_at_stop: the CUDA kernel. One launch, one thread block per row.
//
// Phase 1: the block's threads stride over the row and reduce the position of
// the first stop token with a shared-memory atomicMin. Phase 2: each thread
// writes its positions (token or pad, mask) from that position. The row is read
// twice, but the second read of a 16–32 KiB row hits L1/L2, so the kernel stays
// bound by one DRAM read and the writes.
#include "truncate_at_stop.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <climits>

namespace fastppo {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxSharedStops = 32;

template <typename index_t>
__global__ void truncate_rows_kernel(const index_t* __restrict__ in, const int64_t* __restrict__ stops,
                                     int num_stops, index_t pad, int64_t T, index_t* __restrict__ out,
                                     int64_t* __restrict__ lengths, bool* __restrict__ mask,
                                     bool* __restrict__ has_stop) {
  __shared__ long long first_stop;
  __shared__ int64_t shared_stops[kMaxSharedStops];
  const int64_t b = blockIdx.x;
  const index_t* row = in + b * T;
  if (threadIdx.x == 0) first_stop = LLONG_MAX;
  for (int s = threadIdx.x; s < num_stops && s < kMaxSharedStops; s += blockDim.x) shared_stops[s] = stops[s];
  __syncthreads();
  const int64_t* stop_table = num_stops <= kMaxSharedStops ? shared_stops : stops;

  long long local_first = LLONG_MAX;
  for (int64_t t = threadIdx.x; t < T; t += blockDim.x) {
    const int64_t tok = static_cast<int64_t>(row[t]);
    bool is_stop = false;
    for (int s = 0; s < num_stops; ++s) is_stop |= (tok == stop_table[s]);
    if (is_stop) {
      local_first = t;  // strided loop: the first hit is this thread's smallest
      break;
    }
  }
  if (local_first != LLONG_MAX) atomicMin(&first_stop, local_first);
  __syncthreads();

  const bool stopped = first_stop != LLONG_MAX;
  const int64_t length = stopped ? first_stop + 1 : T;  // the stop token is kept
  for (int64_t t = threadIdx.x; t < T; t += blockDim.x) {
    const bool keep = t < length;
    out[b * T + t] = keep ? row[t] : pad;
    mask[b * T + t] = keep;
  }
  if (threadIdx.x == 0) {
    lengths[b] = length;
    has_stop[b] = stopped;
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> truncate_at_stop_cuda(const at::Tensor& responses,
                                                                                const at::Tensor& stop_ids,
                                                                                int64_t pad_id) {
  auto outs = check_and_allocate(responses, stop_ids, pad_id);
  const c10::cuda::CUDAGuard guard(responses.device());
  auto in = responses.contiguous();
  auto stops = stop_ids.contiguous();
  const auto B = in.size(0);
  const auto T = in.size(1);
  if (B == 0) return {outs.truncated, outs.lengths, outs.mask, outs.has_stop};
  TORCH_CHECK(stops.numel() <= INT_MAX, "too many stop_ids");
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_INDEX_TYPES(in.scalar_type(), "truncate_at_stop_cuda", [&] {
    truncate_rows_kernel<index_t><<<static_cast<unsigned int>(B), kThreads, 0, stream>>>(
        in.data_ptr<index_t>(), stops.data_ptr<int64_t>(), static_cast<int>(stops.numel()),
        static_cast<index_t>(pad_id), T, outs.truncated.data_ptr<index_t>(), outs.lengths.data_ptr<int64_t>(),
        outs.mask.data_ptr<bool>(), outs.has_stop.data_ptr<bool>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {outs.truncated, outs.lengths, outs.mask, outs.has_stop};
}

}  // namespace

TORCH_LIBRARY_IMPL(fastppo, CUDA, m) { m.impl("truncate_at_stop", &truncate_at_stop_cuda); }

}  // namespace fastppo
