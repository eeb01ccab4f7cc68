// Argument validation of _load_batch, shared by the CPU and CUDA kernels.
#pragma once

#include <string>

#include <ATen/ATen.h>

#include "checks.h"

namespace dqn_ops {

constexpr const char* kLoadBatchOp = "dqn_ops._load_batch";
constexpr int kMaxBatchCopies = 8;

// dst[i] <- src[i]: as many of each, at most kMaxBatchCopies; every pair of one dtype and one
// number of elements, contiguous, on dst[0]'s device; no dst shares memory with any src or
// with another dst.
inline void check_load_batch_args(at::TensorList dst, at::TensorList src) {
  const char* op = kLoadBatchOp;
  DQN_CHECK(dst.size() == src.size(), op, ": expected as many sources as destinations, got ", src.size(), " and ",
            dst.size());
  DQN_CHECK(dst.size() <= static_cast<size_t>(kMaxBatchCopies), op, ": at most ", kMaxBatchCopies,
            " tensors, got ", dst.size());
  for (size_t i = 0; i < dst.size(); ++i) {
    const std::string d = "dst[" + std::to_string(i) + "]", s = "src[" + std::to_string(i) + "]";
    check_device(dst[i], op, d.c_str(), dst[0].device());
    check_device(src[i], op, s.c_str(), dst[0].device());
    check_dtype(src[i], op, s.c_str(), dst[i].scalar_type());
    DQN_CHECK(src[i].numel() == dst[i].numel(), op, ": ", s, ": expected ", dst[i].numel(), " elements (as ", d,
              "), got ", src[i].numel());
    check_contiguous(dst[i], op, d.c_str());
    check_contiguous(src[i], op, s.c_str());
    for (size_t j = 0; j < dst.size(); ++j) {
      const std::string sj = "src[" + std::to_string(j) + "]", dj = "dst[" + std::to_string(j) + "]";
      check_no_overlap(dst[i], d.c_str(), src[j], sj.c_str(), op);
      if (j > i) check_no_overlap(dst[i], d.c_str(), dst[j], dj.c_str(), op);
    }
  }
}

}  // namespace dqn_ops
