// truncate_at_stop: schema, shared checks and the CPU kernel.
//
// For each row of generated ids, keep tokens up to and including the first
// stop token (any of `stop_ids`), replace every later token by `pad_id`, and
// report the kept length, the keep-mask and whether a stop token was seen.
// Rows run in parallel with at::parallel_for.
#include "truncate_at_stop.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>

#include <cstdlib>
#endif

namespace fastppo {

#if defined(__linux__)
// Large CPU outputs are written once, straight after allocation, so their cost
// is dominated by first-touch page faults (measured here: 15 ms of a 17 ms
// fresh 32 MiB write, 2 ms when the buffer already exists). Allocating them
// 2 MiB-aligned with MADV_HUGEPAGE lets transparent huge pages back them (THP
// in "madvise" mode is the common default): 16 faults instead of 8192.
constexpr size_t kHugePage = size_t{2} << 20;

static at::Tensor empty_for_streaming_write(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const size_t bytes = c10::multiply_integers(sizes) * options.dtype().itemsize();
  if (bytes < 4 * kHugePage) return at::empty(sizes, options);
  const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  void* data = nullptr;
  if (posix_memalign(&data, kHugePage, rounded) != 0) return at::empty(sizes, options);
  madvise(data, rounded, MADV_HUGEPAGE);  // advisory: without THP this is a plain allocation
  return at::from_blob(data, sizes, [](void* p) { std::free(p); }, options);
}
#else
static at::Tensor empty_for_streaming_write(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::empty(sizes, options);
}
#endif

// Every message below is one std::string, built with std::to_string: TORCH_CHECK with several arguments formats
// them through std::ostringstream, and a toolchain that links libstdc++ into this library statically (the GPU
// image's does) gives it its own locale, never initialised. There a streamed number came out empty (this op built
// with -static-libstdc++ on a CPU) or crashed the process (on an H200; bench/RESULTS.md, issue 37).
TruncateOutputs check_and_allocate(const at::Tensor& responses, const at::Tensor& stop_ids, int64_t pad_id) {
  const auto dtype_name = [](const at::Tensor& t) { return std::string(c10::toString(t.scalar_type())); };
  TORCH_CHECK(responses.dim() == 2, "responses must be 2-D [B, T], got " + std::to_string(responses.dim()) + "-D");
  TORCH_CHECK(responses.scalar_type() == at::kLong || responses.scalar_type() == at::kInt,
              "responses must be int32 or int64, got " + dtype_name(responses));
  TORCH_CHECK(stop_ids.dim() == 1 && stop_ids.numel() > 0, "stop_ids must be a non-empty 1-D tensor");
  TORCH_CHECK(stop_ids.scalar_type() == at::kLong, "stop_ids must be int64, got " + dtype_name(stop_ids));
  TORCH_CHECK(stop_ids.device() == responses.device(),
              "stop_ids is on " + stop_ids.device().str() + " but responses is on " + responses.device().str());
  TORCH_CHECK(pad_id >= 0, "pad_id must be >= 0, got " + std::to_string(pad_id));
  TORCH_CHECK(responses.scalar_type() == at::kLong || pad_id <= std::numeric_limits<int32_t>::max(),
              "pad_id " + std::to_string(pad_id) + " does not fit in int32 responses");
  const auto B = responses.size(0);
  const auto T = responses.size(1);
  auto long_opts = responses.options().dtype(at::kLong);
  auto bool_opts = responses.options().dtype(at::kBool);
  if (responses.is_cpu()) {
    return {empty_for_streaming_write({B, T}, responses.options()), at::empty({B}, long_opts),
            empty_for_streaming_write({B, T}, bool_opts), at::empty({B}, bool_opts)};
  }
  return {at::empty({B, T}, responses.options()), at::empty({B}, long_opts), at::empty({B, T}, bool_opts),
          at::empty({B}, bool_opts)};
}

namespace {

// Position of the first stop token in row[0, T), or T. The single-id case (the
// common one) is a plain compare loop the compiler unrolls; ids that do not fit
// in index_t can never match and were dropped by the caller.
template <typename index_t>
inline int64_t first_stop(const index_t* row, int64_t T, const index_t* stops, int64_t num_stops) {
  if (num_stops == 1) {
    const index_t stop = stops[0];
    for (int64_t t = 0; t < T; ++t) {
      if (row[t] == stop) return t;
    }
    return T;
  }
  for (int64_t t = 0; t < T; ++t) {
    bool hit = false;
    for (int64_t s = 0; s < num_stops; ++s) hit |= row[t] == stops[s];
    if (hit) return t;
  }
  return T;
}

template <typename index_t>
void truncate_rows_cpu(const index_t* in, const index_t* stops, int64_t num_stops, index_t pad, int64_t B, int64_t T,
                       index_t* out, int64_t* lengths, bool* mask, bool* has_stop) {
  // Per row: scan to the first stop token, then write the outputs with
  // memcpy/fill/memset. The copy re-reads the scanned prefix, but from L1/L2
  // (a row is T·8 bytes), so DRAM sees one read of the input.
  // Grain of 16 rows: a row is T tokens, so even short rows amortise the task.
  at::parallel_for(0, B, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const index_t* row = in + b * T;
      const int64_t first = num_stops > 0 ? first_stop(row, T, stops, num_stops) : T;
      const bool stopped = first < T;
      const int64_t length = stopped ? first + 1 : T;  // the stop token is kept
      std::memcpy(out + b * T, row, static_cast<size_t>(length) * sizeof(index_t));
      std::fill(out + b * T + length, out + (b + 1) * T, pad);
      std::memset(mask + b * T, 1, static_cast<size_t>(length));
      std::memset(mask + b * T + length, 0, static_cast<size_t>(T - length));
      lengths[b] = length;
      has_stop[b] = stopped;
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> truncate_at_stop_cpu(const at::Tensor& responses,
                                                                               const at::Tensor& stop_ids,
                                                                               int64_t pad_id) {
  auto outs = check_and_allocate(responses, stop_ids, pad_id);
  auto in = responses.contiguous();
  auto stops = stop_ids.contiguous();
  const auto B = in.size(0);
  const auto T = in.size(1);
  AT_DISPATCH_INDEX_TYPES(in.scalar_type(), "truncate_at_stop_cpu", [&] {
    // Stop ids as index_t; one outside index_t's range can never match a token.
    std::vector<index_t> narrow;
    const int64_t* ids = stops.data_ptr<int64_t>();
    for (int64_t s = 0; s < stops.numel(); ++s) {
      if (ids[s] >= std::numeric_limits<index_t>::min() && ids[s] <= std::numeric_limits<index_t>::max()) {
        narrow.push_back(static_cast<index_t>(ids[s]));
      }
    }
    truncate_rows_cpu<index_t>(in.data_ptr<index_t>(), narrow.data(), static_cast<int64_t>(narrow.size()),
                               static_cast<index_t>(pad_id), B, T, outs.truncated.data_ptr<index_t>(),
                               outs.lengths.data_ptr<int64_t>(), outs.mask.data_ptr<bool>(),
                               outs.has_stop.data_ptr<bool>());
  });
  return {outs.truncated, outs.lengths, outs.mask, outs.has_stop};
}

}  // namespace

TORCH_LIBRARY(fastppo, m) {
  m.def("truncate_at_stop(Tensor responses, Tensor stop_ids, int pad_id) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastppo, CPU, m) { m.impl("truncate_at_stop", &truncate_at_stop_cpu); }

}  // namespace fastppo

// Lets the ahead-of-time build be imported as the Python module fastppo._C; the
// import itself registers the ops above with the dispatcher.
#include <Python.h>
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "fastppo C++/CUDA ops (torch.ops.fastppo)",
                                          -1, nullptr};
  return PyModule_Create(&module_def);
}
