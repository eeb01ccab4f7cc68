// CPU kernel of _load_batch: each destination takes its source's bytes.
#include <cstring>

#include <torch/library.h>

#include "batch_args.h"

namespace dqn_ops {
namespace {

void load_batch_cpu(at::TensorList dst, at::TensorList src) {
  check_load_batch_args(dst, src);
  for (size_t i = 0; i < dst.size(); ++i)
    if (dst[i].nbytes() > 0) std::memcpy(dst[i].data_ptr(), src[i].data_ptr(), dst[i].nbytes());
}

}  // namespace

TORCH_LIBRARY_IMPL(dqn_ops, CPU, m) { m.impl("_load_batch", &load_batch_cpu); }

}  // namespace dqn_ops
