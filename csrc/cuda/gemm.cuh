// Row-major GEMM on torch's cuBLAS handle and current stream.
#pragma once

#include <climits>

#include <ATen/cuda/CUDAContext.h>
#include <c10/util/Exception.h>

#include "checks.h"
#include <cublas_v2.h>

namespace dqn_ops {
namespace cuda {

// A row-major matrix operand: op(X) = X (trans = false) or X^T of the matrix stored at ptr
// with `ld` elements between rows.
struct Operand {
  const void* ptr;
  cudaDataType_t type;
  int64_t ld;
  bool trans;
};

// C_i[M, N] (row-major, ldc, F32 or BF16) = op(A_i)[M, K] @ op(B_i)[K, N] for i < batch, with
// X_i = X + i * stride_x (elements).
//
// cuBLAS is column-major, and a row-major X is the column-major X^T, so this computes
// C^T = op(B)^T op(A)^T: the operands swap places and M, N swap roles. alpha = 1; with
// beta = 0 C is overwritten (its old contents are not read), with beta = 1 the product is
// added to it (C_i = op(A_i) op(B_i) + C_i: the C_i of one batch must not overlap).
// Both operands must have one type (docs/design.md: cuBLAS refuses F32 x BF16).
inline void gemm_strided_batched(const char* op, const char* what, int64_t M, int64_t N, int64_t K, const Operand& A,
                                 int64_t stride_a, const Operand& B, int64_t stride_b, void* C, cudaDataType_t c_type,
                                 int64_t ldc, int64_t stride_c, int64_t batch, cublasComputeType_t compute,
                                 float beta = 0.f) {
  DQN_CHECK(M <= INT_MAX && N <= INT_MAX && K <= INT_MAX && A.ld <= INT_MAX && B.ld <= INT_MAX && ldc <= INT_MAX &&
                batch <= INT_MAX, op, ": GEMM ", what, " too large for cuBLAS's int sizes (M=", M, ", N=", N, ", K=",
            K, ")");
  // getCurrentCUDABlasHandle binds torch's current stream and its workspace to the handle.
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  const float alpha = 1.f;
  const cublasOperation_t op_b = B.trans ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = A.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasStatus_t st =
      batch == 1 ? cublasGemmEx(handle, op_b, op_a, static_cast<int>(N), static_cast<int>(M), static_cast<int>(K),
                                &alpha, B.ptr, B.type, static_cast<int>(B.ld), A.ptr, A.type, static_cast<int>(A.ld),
                                &beta, C, c_type, static_cast<int>(ldc), compute, CUBLAS_GEMM_DEFAULT)
                 : cublasGemmStridedBatchedEx(handle, op_b, op_a, static_cast<int>(N), static_cast<int>(M),
                                              static_cast<int>(K), &alpha, B.ptr, B.type, static_cast<int>(B.ld),
                                              stride_b, A.ptr, A.type, static_cast<int>(A.ld), stride_a, &beta, C,
                                              c_type, static_cast<int>(ldc), stride_c, static_cast<int>(batch),
                                              compute, CUBLAS_GEMM_DEFAULT);
  DQN_CHECK(st == CUBLAS_STATUS_SUCCESS, op, ": cuBLAS GEMM for ", what, " (M=", M, ", N=", N, ", K=", K,
            ", batch=", batch, ") failed: ", cublasGetStatusString(st));
}

// One GEMM: C[M, N] = op(A)[M, K] @ op(B)[K, N] (+ C with beta = 1; row-major, see
// gemm_strided_batched).
inline void gemm(const char* op, const char* what, int64_t M, int64_t N, int64_t K, const Operand& A,
                 const Operand& B, void* C, cudaDataType_t c_type, int64_t ldc, cublasComputeType_t compute,
                 float beta = 0.f) {
  gemm_strided_batched(op, what, M, N, K, A, 0, B, 0, C, c_type, ldc, 0, 1, compute, beta);
}

}  // namespace cuda
}  // namespace dqn_ops
