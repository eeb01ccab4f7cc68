// bf16_dueling_forward's launches up to the output layer, for the ops that continue from its
// GEMM results with a kernel of their own (act.cu). Defined in dueling_forward.cu.
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "layout.h"

namespace dqn_ops {
namespace cuda {

// Everything up to the aggregation: the output layer's GEMM results in the padded layout
// (no bias) and the activations the backward reads: [x, h_1, ..., h_M], x the states cast to
// BF16 and h_i hidden layer i's output (M = L.trunk_layers + L.head_layers), BF16 [rows, width] each.
struct Logits {
  at::Tensor logits;
  std::vector<at::Tensor> activations;
};

// states [rows, SD] F32 (checked by the caller: check_forward_args or the like) on the current
// stream of the states' device: the states cast to BF16, every hidden layer, the output
// GEMMs. The same launches and bits as bf16_dueling_forward up to its last kernel. An IQN
// network takes fractions [rows, N] F32 (checked: check_fractions): the logits and the
// activations from the cosines on lie on rows * N rows (csrc/layout.h, num_activations).
Logits forward_to_logits(const char* op, const at::Tensor& states, const at::Tensor& params,
                         const at::Tensor& params_bf16, const NetLayout& L,
                         const c10::optional<at::Tensor>& fractions = c10::nullopt);

}  // namespace cuda
}  // namespace dqn_ops
