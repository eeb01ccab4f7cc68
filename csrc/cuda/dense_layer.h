// dqn_ops's own BF16 tensor-core GEMM (mma.sync, F32 accumulation) with the work after a layer's
// GEMM in its epilogue, for a list of GEMMs in one launch. Defined in dense_layer.cu. Three uses,
// each where dense_applies holds and otherwise the cuBLAS GEMM plus a pass of its own:
//   - kHidden, a dense hidden layer (hidden_layers, dueling_forward.cu): out = bf16(relu(x W^T +
//     b)), the F32 bias, ReLU and the rounding in the epilogue, for one network or both of the
//     trainer's batched pass (a problem each); IQN's phi layer with z = bf16(scale * out) too.
//   - kLogits, the output layer (output_logits_into): out = x W^T in F32, every head of one
//     network, or of both, one problem each: one launch where cuBLAS took a GEMM per head group
//     and network.
//   - kInputGrad, a layer's input gradient in the backward (mixed_backward.cu): out = x W (W read
//     as stored, [K, N], transposed in the tile loads) masked by the next ReLU, out = h > 0 ? acc :
//     0, in F32 with its BF16 copy: the relu_backward pass after the GEMM is gone. One problem a
//     block of the layer (their input columns disjoint). Optionally the F32 gradient's column
//     sums by row tiles (the layer's bias gradient, finished by mixed_backward's column sums) in
//     place of the F32 gradient itself, which then is neither written nor read back.
//
// Why: cuBLAS's epilogues take the bias in the output's type and have no ReLU mask from another
// tensor (docs/design.md), so each hidden layer wrote F32 and a second pass read it back (at
// [16384, 512] ~67 MB a layer); and at small batches each launch on the step's critical path
// costs more than its arithmetic, which one launch for a layer's heads (or both networks') saves.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace dqn_ops {
namespace cuda {

enum class DenseEpilogue { kHidden, kLogits, kInputGrad };

// One GEMM of a launch: rows x N outputs over K, every matrix row-major with its own row stride.
//   x [rows, K] (x_ld);
//   w [N, K] (w_ld) for kHidden and kLogits; [K, N] (w_ld) for kInputGrad (a layer's weight as
//     stored, [out, in], read for x W);
//   out [rows, N] (out_ld): BF16 for kHidden, F32 for kLogits and kInputGrad;
//   bias [N] F32 (kHidden);
//   aux [rows, N] (out_ld) BF16: kInputGrad's ReLU mask h (null: no mask, out = acc); kHidden's
//     scale, at row r / scale_group (IQN's h_L), with out_bf16 set;
//   out_bf16 [rows, N] (out_ld): kInputGrad's BF16 copy of out (null: none); kHidden's scaled
//     output bf16(scale * out) (null: none).
//   col_sums (kInputGrad with a mask and out_bf16, the staged stores only; null: none): the
//     column sums of the F32 out by halves of each tile's rows, [dense_column_sum_rows(rows,
//     tile rows), N] (out_ld): row 2 i + h holds half h of row tile i (each half's rows added in
//     order into four accumulators, row r to r % 4, then (a0 + a1) + (a2 + a3)). With col_sums
//     set, out may be null: the F32 gradient is then not stored, as when only its column sums
//     (a bias gradient) read it.
//   fractions (kHidden, K <= kDenseFormedXMaxK, batch 1; null: none): x is not read but formed in
//     the kernel as IQN's cosines of fractions[r] (elementwise.cuh, iqn_cosines8: the cosine
//     kernel's bits), and stored to x_out [rows, K] (x_ld) by the blocks of the first column tile,
//     for the backward: IQN's phi layer without the cosine launch before it.
// A problem may be a batch of `batch` same-shape GEMMs (a group of heads, NetLayout's
// block_groups): member i reads x + i * x_stride and w + i * w_stride and writes out + i *
// out_stride (aux, out_bf16 and bias move by out_stride too); their outputs must not overlap.
struct DenseProblem {
  const __nv_bfloat16* x = nullptr;
  const __nv_bfloat16* w = nullptr;
  int64_t x_ld = 0, w_ld = 0;
  void* out = nullptr;
  int64_t out_ld = 0;
  const float* bias = nullptr;
  const __nv_bfloat16* aux = nullptr;
  __nv_bfloat16* out_bf16 = nullptr;
  float* col_sums = nullptr;
  const float* fractions = nullptr;
  __nv_bfloat16* x_out = nullptr;
  int64_t rows = 0, N = 0, K = 0;
  int64_t batch = 1;
  int64_t x_stride = 0, w_stride = 0, out_stride = 0;
};

// The GEMMs of one launch, all of one epilogue. add() returns false once full (kMaxProblems).
struct DenseLaunch {
  static constexpr int kMaxProblems = 16;
  DenseEpilogue epilogue = DenseEpilogue::kHidden;
  int count = 0;
  int64_t scale_group = 1;  // kHidden's scaled output: rows per row of `aux`
  DenseProblem problem[kMaxProblems];
  // Filled by dense_launch: problem p's tiles are the blocks [first_tile[p], first_tile[p + 1]).
  int first_tile[kMaxProblems + 1] = {};

  explicit DenseLaunch(DenseEpilogue e) : epilogue(e) {}
  bool add(const DenseProblem& p) {
    if (count == kMaxProblems) return false;
    problem[count++] = p;
    return true;
  }
};

// Whether dense_launch runs `l` on the current device: the switch (csrc/dense_layer_mode.h: off,
// on, or auto's rule, by each problem's shape and rows), sm_80 or newer, and for every problem: rows,
// N and K positive and within int; K a multiple of 8 (and N too for kInputGrad) and x, w and their
// row and batch strides 16-byte aligned (the tiles are copied 16 bytes at a time); N, out_ld and
// out_stride even and the outputs, aux and out_bf16 aligned for the pairs the epilogue stores;
// bias set for kHidden; a scaled output only with one problem of batch 1 and scale_group > 0;
// col_sums only on kInputGrad with aux and out_bf16 set, 4-byte aligned, where the launch stages
// its stores (DQN_OPS_DENSE_STORES=all and every output row whole 16-byte chunks); at most 2^31 -
// 1 tiles in all.
bool dense_applies(const DenseLaunch& l);

// Launches `l` on `stream` (dense_applies(l) must hold) and returns the rows of the tile shape
// it ran. Every output element is the same bits for any rows, any other problems and any tile
// shape: its K products are summed in one fixed order (tensor-core steps of 16 along K from k =
// 0), then the epilogue's formula. The column sums (col_sums) depend on the tile's rows.
int dense_launch(DenseLaunch l, cudaStream_t stream);

// The widest x the kernel forms from fractions: one K tile.
constexpr int64_t kDenseFormedXMaxK = 64;

// The fewest rows of a tile shape, and the rows of a problem's col_sums for `rows` rows on tiles
// of `tile_rows` (two halves a row tile): a buffer of dense_column_sum_rows(rows,
// kDenseMinTileRows) rows holds any shape's.
constexpr int kDenseMinTileRows = 32;
constexpr int kColumnSumHalves = 2;
constexpr int64_t dense_column_sum_rows(int64_t rows, int tile_rows) {
  return kColumnSumHalves * ((rows + tile_rows - 1) / tile_rows);
}

}  // namespace cuda
}  // namespace dqn_ops
