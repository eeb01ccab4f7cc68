// bf16_dueling_forward's launches up to the output layer, for the ops that continue from its
// GEMM results with a kernel of their own (act.cu). Defined in dueling_forward.cu.
#pragma once

#include <ATen/core/Tensor.h>

#include "layout.h"

namespace dqn_ops {
namespace cuda {

// Everything up to the aggregation: the output layer's GEMM results in the padded layout
// (no bias) and the activations the backward reads.
struct Logits {
  at::Tensor logits, x, h1, h2, hh;
};

// states [rows, SD] F32 (checked by the caller: check_forward_args or the like) on the current
// stream of the states' device: the states cast to BF16, the three hidden layers, the output
// GEMMs. The same launches and bits as bf16_dueling_forward up to its last kernel.
Logits forward_to_logits(const char* op, const at::Tensor& states, const at::Tensor& params,
                         const at::Tensor& params_bf16, const NetLayout& L);

}  // namespace cuda
}  // namespace dqn_ops
