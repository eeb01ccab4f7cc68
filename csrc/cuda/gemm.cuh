// Row-major GEMM on torch's cuBLAS handle and current stream.
#pragma once

#include <climits>
#include <cstdlib>
#include <cstring>

#include <ATen/cuda/CUDAContext.h>
#include <c10/util/Exception.h>

#include "checks.h"
#include <cublasLt.h>
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
// C^T = op(B)^T op(A)^T: the operands swap places and M, N swap roles. alpha = 1, beta = 0.
// Both operands must have one type (DESIGN.md fact 1: cuBLAS refuses F32 x BF16).
inline void gemm_strided_batched(const char* op, const char* what, int64_t M, int64_t N, int64_t K, const Operand& A,
                                 int64_t stride_a, const Operand& B, int64_t stride_b, void* C, cudaDataType_t c_type,
                                 int64_t ldc, int64_t stride_c, int64_t batch, cublasComputeType_t compute) {
  DQN_CHECK(M <= INT_MAX && N <= INT_MAX && K <= INT_MAX && A.ld <= INT_MAX && B.ld <= INT_MAX && ldc <= INT_MAX &&
                batch <= INT_MAX, op, ": GEMM ", what, " too large for cuBLAS's int sizes (M=", M, ", N=", N, ", K=",
            K, ")");
  // getCurrentCUDABlasHandle binds torch's current stream and its workspace to the handle.
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  const float alpha = 1.f, beta = 0.f;
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

// One GEMM: C[M, N] = op(A)[M, K] @ op(B)[K, N] (row-major, see gemm_strided_batched).
inline void gemm(const char* op, const char* what, int64_t M, int64_t N, int64_t K, const Operand& A,
                 const Operand& B, void* C, cudaDataType_t c_type, int64_t ldc, cublasComputeType_t compute) {
  gemm_strided_batched(op, what, M, N, K, A, 0, B, 0, C, c_type, ldc, 0, 1, compute);
}

// Owns the cuBLASLt descriptors of one call (destroyed on every path out).
struct LtCall {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtCall() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

// Whether the hidden layers' bias + ReLU go into the GEMM's epilogue (gemm_bias_relu_bf16);
// DQN_OPS_GEMM_EPILOGUE=0 keeps them in the separate kernel (A/B measurements).
inline bool gemm_epilogue_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("DQN_OPS_GEMM_EPILOGUE");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  return enabled;
}

// H[M, N] (row-major BF16, ldh) = bf16(relu(X[M, K] @ W[N, K]^T + bias[N])): BF16 operands, F32
// accumulation, the F32 bias and the ReLU in cuBLASLt's epilogue, one rounding to BF16: the
// same arithmetic as a GEMM with an F32 output followed by bias_relu_bf16_kernel, one launch and
// no F32 round trip (but for a NaN pre-activation if cuBLASLt's ReLU is max(x, 0): the kernel
// keeps it; tests/test_network.py pins it down). cuBLASLt is column-major: it computes
// H^T[N, M] = op(W)[N, K] X^T[K, M], W stored row-major [N, K] being column-major [K, N]
// (op = T) and X row-major [M, K] column-major [K, M]. Returns false, having done nothing, when
// cuBLASLt offers no algorithm for it (e.g. no F32 bias with a BF16 output) or the epilogue is
// switched off; the caller then runs the GEMM and the bias + ReLU kernel.
inline bool gemm_bias_relu_bf16(const char* op, const char* what, int64_t M, int64_t N, int64_t K, const void* X,
                                int64_t ldx, const void* W, int64_t ldw, const float* bias, void* H, int64_t ldh) {
  if (!gemm_epilogue_enabled()) return false;
  DQN_CHECK(M <= INT_MAX && N <= INT_MAX && K <= INT_MAX, op, ": GEMM ", what, " too large for cuBLASLt (M=", M,
            ", N=", N, ", K=", K, ")");
  auto check = [&](cublasStatus_t st, const char* call) {
    DQN_CHECK(st == CUBLAS_STATUS_SUCCESS, op, ": cuBLASLt ", call, " for ", what, " (M=", M, ", N=", N, ", K=",
              K, ") failed: ", cublasGetStatusString(st));
  };
  LtCall c;
  check(cublasLtMatmulDescCreate(&c.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate");
  const cublasOperation_t trans_w = CUBLAS_OP_T, trans_x = CUBLAS_OP_N;
  const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_RELU_BIAS;
  const int32_t bias_type = CUDA_R_32F;
  check(cublasLtMatmulDescSetAttribute(c.desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_w, sizeof(trans_w)), "TRANSA");
  check(cublasLtMatmulDescSetAttribute(c.desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_x, sizeof(trans_x)), "TRANSB");
  check(cublasLtMatmulDescSetAttribute(c.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)),
        "EPILOGUE");
  check(cublasLtMatmulDescSetAttribute(c.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)),
        "BIAS_POINTER");
  // Not settable on every cuBLASLt: then there is no F32 bias with a BF16 output here.
  if (cublasLtMatmulDescSetAttribute(c.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)) !=
      CUBLAS_STATUS_SUCCESS)
    return false;
  check(cublasLtMatrixLayoutCreate(&c.a, CUDA_R_16BF, K, N, ldw), "MatrixLayoutCreate (W)");
  check(cublasLtMatrixLayoutCreate(&c.b, CUDA_R_16BF, K, M, ldx), "MatrixLayoutCreate (X)");
  check(cublasLtMatrixLayoutCreate(&c.d, CUDA_R_16BF, N, M, ldh), "MatrixLayoutCreate (H)");
  const size_t workspace_bytes = at::cuda::getCUDABlasLtWorkspaceSize();
  check(cublasLtMatmulPreferenceCreate(&c.pref), "MatmulPreferenceCreate");
  check(cublasLtMatmulPreferenceSetAttribute(c.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                             sizeof(workspace_bytes)),
        "MAX_WORKSPACE_BYTES");
  cublasLtHandle_t lt = at::cuda::getCurrentCUDABlasLtHandle();
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(lt, c.desc, c.a, c.b, c.d, c.d, c.pref, 1, &result, &found);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || (st == CUBLAS_STATUS_SUCCESS && found == 0)) return false;
  check(st, "MatmulAlgoGetHeuristic");
  const float alpha = 1.f, beta = 0.f;
  check(cublasLtMatmul(lt, c.desc, &alpha, W, c.a, X, c.b, &beta, H, c.d, H, c.d, &result.algo,
                       at::cuda::getCUDABlasLtWorkspace(), workspace_bytes, at::cuda::getCurrentCUDAStream()),
        "Matmul");
  return true;
}

}  // namespace cuda
}  // namespace dqn_ops
