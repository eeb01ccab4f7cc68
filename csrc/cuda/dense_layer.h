// A dense hidden layer in one kernel: out = bf16(relu(x W^T + b)), BF16 tensor cores with F32
// accumulation, the F32 bias, ReLU and the rounding to BF16 in the GEMM's epilogue. Defined in
// dense_layer.cu; hidden_layers (dueling_forward.cu) runs a dense layer through it where
// dense_layer_applies, and otherwise through a cuBLAS GEMM with an F32 output and the bias + ReLU
// pass.
//
// Why: cuBLAS's epilogues take the bias in the output's type (docs/design.md), so with cuBLAS a
// hidden layer writes its F32 pre-activations and a second pass reads them back: at [16384, 512]
// that is ~67 MB of traffic a layer that this kernel does not make, and one launch fewer.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace dqn_ops {
namespace cuda {

// One layer of one or two networks on row-major operands. Network n < nets reads
// x + n * x_net_stride [rows, K] (row stride K), w + n * w_net_stride [N, K] (row stride K), its
// bias (bias_lo for n = 0, bias_hi for n = 1) [N], and writes out + n * out_net_stride
// [rows, N] (row stride N).
struct DenseLayerArgs {
  const __nv_bfloat16* x;
  int64_t x_net_stride;
  const __nv_bfloat16* w;
  int64_t w_net_stride;
  const float* bias_lo;
  const float* bias_hi;
  __nv_bfloat16* out;
  int64_t out_net_stride;
  int64_t rows, N, K;
  int nets;
  // Optional, one network only (IQN's phi layer, whose output z = h_L[r / N] * phi the heads
  // read): with scaled_out set, also scaled_out[r, c] = bf16(scale[r / scale_group, c] *
  // out[r, c]), scale BF16 [ceil(rows / scale_group), N] and scaled_out [rows, N] (row stride N).
  const __nv_bfloat16* scale = nullptr;
  int64_t scale_group = 1;
  __nv_bfloat16* scaled_out = nullptr;
};

// Whether dense_layer runs `a` on the current device: the switch (csrc/dense_layer_mode.h: off,
// on, or auto's rule: N >= 128), sm_80 or newer, K a multiple of 8 and 16-byte aligned rows and
// network strides (the operand tiles are copied 16 bytes at a time), N even and `out` 4-byte
// aligned (the outputs are stored in pairs), the scaled output (one network, `scale` and
// `scaled_out` 4-byte aligned), N and K within int, and at most 65535 row tiles (the grid's y).
bool dense_layer_applies(const DenseLayerArgs& a);

// Launches the layer on `stream` (dense_layer_applies(a) must hold). Every output element is the
// same bits for any rows, nets and tile shape: its K products are summed in one fixed order
// (tensor-core steps of 16 along K from k = 0), then the bias is added and the sum rounded.
void dense_layer(const DenseLayerArgs& a, cudaStream_t stream);

}  // namespace cuda
}  // namespace dqn_ops
