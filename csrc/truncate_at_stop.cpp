// truncate_at_stop: schema, shared checks and the CPU kernel.
//
// For each row of generated ids, keep tokens up to and including the first
// stop token (any of `stop_ids`), replace every later token by `pad_id`, and
// report the kept length, the keep-mask and whether a stop token was seen.
// One pass per row; rows run in parallel with at::parallel_for.
#include "truncate_at_stop.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

namespace fastppo {

TruncateOutputs check_and_allocate(const at::Tensor& responses, const at::Tensor& stop_ids, int64_t pad_id) {
  TORCH_CHECK(responses.dim() == 2, "responses must be 2-D [B, T], got ", responses.dim(), "-D");
  TORCH_CHECK(responses.scalar_type() == at::kLong || responses.scalar_type() == at::kInt,
              "responses must be int32 or int64, got ", responses.scalar_type());
  TORCH_CHECK(stop_ids.dim() == 1 && stop_ids.numel() > 0, "stop_ids must be a non-empty 1-D tensor");
  TORCH_CHECK(stop_ids.scalar_type() == at::kLong, "stop_ids must be int64, got ", stop_ids.scalar_type());
  TORCH_CHECK(stop_ids.device() == responses.device(), "stop_ids is on ", stop_ids.device(),
              " but responses is on ", responses.device());
  TORCH_CHECK(pad_id >= 0, "pad_id must be >= 0, got ", pad_id);
  const auto B = responses.size(0);
  const auto T = responses.size(1);
  auto long_opts = responses.options().dtype(at::kLong);
  auto bool_opts = responses.options().dtype(at::kBool);
  return {at::empty({B, T}, responses.options()), at::empty({B}, long_opts), at::empty({B, T}, bool_opts),
          at::empty({B}, bool_opts)};
}

namespace {

template <typename index_t>
void truncate_rows_cpu(const index_t* in, const int64_t* stops, int64_t num_stops, index_t pad, int64_t B,
                       int64_t T, index_t* out, int64_t* lengths, bool* mask, bool* has_stop) {
  // Grain of 16 rows: a row is T tokens, so even short rows amortise the task.
  at::parallel_for(0, B, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const index_t* row = in + b * T;
      index_t* out_row = out + b * T;
      bool* mask_row = mask + b * T;
      bool stopped = false;
      int64_t length = T;
      for (int64_t t = 0; t < T; ++t) {
        const index_t tok = row[t];
        out_row[t] = stopped ? pad : tok;
        mask_row[t] = !stopped;
        if (!stopped) {
          for (int64_t s = 0; s < num_stops; ++s) {
            if (static_cast<int64_t>(tok) == stops[s]) {
              stopped = true;
              length = t + 1;  // the stop token itself is kept
              break;
            }
          }
        }
      }
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
    truncate_rows_cpu<index_t>(in.data_ptr<index_t>(), stops.data_ptr<int64_t>(), stops.numel(),
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
