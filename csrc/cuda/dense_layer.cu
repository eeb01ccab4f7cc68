// dqn_ops's GEMM kernel (dense_layer.h): BF16 tensor cores (mma.sync m16n8k16, F32
// accumulators), a list of problems a launch, the epilogue a template parameter.
//
// A block computes a BM x BN tile of one problem's output (the blocks are the problems' tiles in
// order); its warps a WM x WN part each. The K dimension runs in tiles of kBK = 64, kStages of
// them in flight: each tile of x and of W is copied global -> shared by cp.async, 16 bytes a copy
// (zero-filled past the rows, N or K), and read into fragments by ldmatrix. An x tile's shared
// rows are 128 bytes, eight 16-byte chunks; chunk c of row r is stored at chunk c ^ (r % 8), so
// the 8 rows an ldmatrix reads (8 consecutive rows, one chunk) fall on 8 different chunks of the
// banks (no conflicts), as do a warp's copies (4 rows, 8 chunks each). W's tiles are the same,
// or for kInputGrad (W read as stored, [K, N]) kBK rows of k, BN columns (BN / 8 chunks) each,
// with the same swizzle on the low three chunk bits and ldmatrix.trans.
//
// Tile shapes (pick_tile): 128 x 128 with 8 warps for large launches, 64 x 64 and 32 x 64 with 4
// warps where the larger tile would leave SMs idle, and 128 x 16 with 4 warps for an output
// layer whose heads are all at most 16 columns wide once padded (one-atom heads: IQN's, MSE's;
// or a branch of few actions and atoms), where a wider tile would compute and load weights for
// columns that do not exist and the launch is bound by reading the heads' input once. Every
// shape accumulates an element's products in the same order (k16 steps from 0), so the choice
// does not change any bit.
#include "dense_layer.h"

#include <climits>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>

#include "../dense_layer_mode.h"
#include "../switches.h"
#include "elementwise.cuh"
#include "pdl.cuh"
#include "smem_limit.h"

namespace dqn_ops {
namespace cuda {
namespace {

constexpr int kBK = 64;           // K elements of a tile: 128 bytes a row
constexpr int kChunks = kBK / 8;  // 16-byte chunks a row
static_assert(kDenseFormedXMaxK == kBK, "a formed x (IQN's cosines) is one K tile");

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; with `valid` false the 16 bytes are zeros (nothing is read).
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
// 4 bytes global -> shared (through L1); with `valid` false the 4 bytes are zeros.
__device__ __forceinline__ void cp_async4(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// The same four 8 x 8 matrices, each transposed: a lane gets the elements of its matrix's column
// pair, so rows of k stored n-contiguous load as the B fragments that rows of n would.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a b: a 16 x 16 (row-major fragment), b 16 x 8 (column-major fragment), F32 accumulators.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Byte offset of chunk c of row r in a tile's shared rows (the swizzle above).
__device__ __forceinline__ unsigned tile_offset(int r, int c) { return r * (kBK * 2) + ((c ^ (r & 7)) << 4); }

template <int BM, int BN, int WM, int WN>
struct Tile {
  // K tiles in flight. The small tiles run launches of few rows, where a block's time is its K
  // loop's load latencies, one for every kStages - 1 tiles: they keep more in flight (the shared
  // memory still holds three blocks an SM).
  static constexpr int kStages = BM == 128 ? 3 : BM == 64 ? 4 : 6;
  static constexpr int kWarps = (BM / WM) * (BN / WN);
  static constexpr int kThreads = kWarps * 32;
  // The large tile's blocks two an SM where the shared memory holds two (sm_90: 2 x 96 KB of
  // 227; the cap of 128 registers a thread keeps the compiler there), so that one block's loads
  // and epilogue overlap the other's tensor-core work; the small tiles' registers leave them at
  // their shared memory's three (0: no minimum asked), the narrow tile's at its four.
  static constexpr int kMinBlocks = BM == 128 && BN == 128 ? 2 : 0;
  static constexpr int MI = WM / 16;  // m16 fragments a warp
  static constexpr int NI = WN / 8;   // n8 fragments a warp
  static constexpr size_t kSmemBytes = size_t(kStages) * (BM + BN) * kBK * sizeof(__nv_bfloat16);
  static_assert(BM == 128 || kSmemBytes <= 227 * 1024 / 3, "a small tile's blocks three an SM");
  static_assert(BM % WM == 0 && BN % WN == 0 && WM % 16 == 0 && WN % 16 == 0, "tile shape");
};

// The problem block `tile` belongs to (a uniform scan of at most kMaxProblems entries).
__device__ __forceinline__ int problem_of(const DenseLaunch& l, int tile) {
  int p = 0;
  while (p + 1 < l.count && tile >= l.first_tile[p + 1]) ++p;
  return p;
}

// The launch is a __grid_constant__ parameter: a problem picked by a run-time index is read from
// the parameter space where it lies, not from a per-thread copy of the whole list.
template <int BM, int BN, int WM, int WN, DenseEpilogue kEpilogue, bool kStagedStores>
__global__ void __launch_bounds__(Tile<BM, BN, WM, WN>::kThreads, Tile<BM, BN, WM, WN>::kMinBlocks)
    dense_layer_kernel(const __grid_constant__ DenseLaunch l) {
  using T = Tile<BM, BN, WM, WN>;
  constexpr int kStages = T::kStages;
  // kInputGrad reads W as stored, [K, N]: its tiles are kBK rows of k, BN columns of n each.
  constexpr bool kTransW = kEpilogue == DenseEpilogue::kInputGrad;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  pdl_enter();

  const int p = problem_of(l, blockIdx.x);
  const DenseProblem& P = l.problem[p];
  const int N = static_cast<int>(P.N), K = static_cast<int>(P.K), rows = static_cast<int>(P.rows);
  // The block's batch member, then its tile: N tiles first, so the blocks that read one tile of
  // x's rows run one after the other.
  const int n_tiles = (N + BN - 1) / BN, member_tiles = (rows + BM - 1) / BM * n_tiles;
  const int member = (blockIdx.x - l.first_tile[p]) / member_tiles;
  const int tile = blockIdx.x - l.first_tile[p] - member * member_tiles;
  const int m0 = tile / n_tiles * BM, n0 = tile % n_tiles * BN;
  const __nv_bfloat16* const x = P.x + member * P.x_stride;
  const __nv_bfloat16* const w = P.w + member * P.w_stride;
  const int64_t x_ld = P.x_ld, w_ld = P.w_ld, out_at = member * P.out_stride;

  // Shared memory: kStages tiles of x's rows ([BM, kBK] each), then kStages of W's ([BN, kBK], or
  // [kBK, BN] transposed).
  constexpr unsigned kATileBytes = BM * kBK * 2, kBTileBytes = BN * kBK * 2;
  const unsigned a_smem = smem_addr(smem_raw), b_smem = a_smem + kStages * kATileBytes;

  // The copies: a thread takes chunk threadIdx.x % kChunks of rows threadIdx.x / kChunks + j *
  // kRowStep, the same rows and chunk every K tile, so their sources and destinations are found once.
  constexpr int kRowStep = T::kThreads / kChunks, kACopies = BM / kRowStep;
  static_assert(BM % kRowStep == 0, "a tile's rows split evenly over the threads");
  const int chunk = threadIdx.x % kChunks, row0 = threadIdx.x / kChunks;
  const __nv_bfloat16* a_src[kACopies];
  unsigned a_dst[kACopies];
#pragma unroll
  for (int j = 0; j < kACopies; ++j) {
    const int r = row0 + j * kRowStep;
    a_src[j] = m0 + r < rows ? x + int64_t(m0 + r) * x_ld + chunk * 8 : nullptr;
    a_dst[j] = a_smem + tile_offset(r, chunk);
  }
  // W's copies: rows of n with chunks of k as x's, or (kTransW) kBK rows of k, each BN / 8 chunks
  // of n: a thread takes chunk threadIdx.x % kBChunks of rows threadIdx.x / kBChunks + j * kBRowStep.
  constexpr int kBChunks = kTransW ? BN / 8 : kChunks;
  constexpr int kBRowStep = T::kThreads / kBChunks, kBCopies = (kTransW ? kBK : BN) / kBRowStep;
  constexpr unsigned kBRowBytes = kTransW ? BN * 2 : kBK * 2;
  static_assert((kTransW ? kBK : BN) % kBRowStep == 0, "a tile's rows split evenly over the threads");
  const int b_chunk = threadIdx.x % kBChunks, b_row0 = threadIdx.x / kBChunks;
  const __nv_bfloat16* b_src[kBCopies];
  unsigned b_dst[kBCopies];
#pragma unroll
  for (int j = 0; j < kBCopies; ++j) {
    const int r = b_row0 + j * kBRowStep;
    if (kTransW)  // row r of the tile is k0 + r of W; its columns n0 + 8 b_chunk..
      b_src[j] = n0 + b_chunk * 8 < N ? w + int64_t(r) * w_ld + n0 + b_chunk * 8 : nullptr;
    else
      b_src[j] = n0 + r < N ? w + int64_t(n0 + r) * w_ld + b_chunk * 8 : nullptr;
    b_dst[j] = b_smem + r * kBRowBytes + ((b_chunk ^ (r & 7)) << 4);
  }
  // x formed in the kernel (dense_layer.h, fractions): IQN's cosines, its one K tile written to
  // stage 0 below instead of copied.
  const bool form_x = kEpilogue == DenseEpilogue::kHidden && P.fractions != nullptr;
  // K tile kt into stage `stage`; rows past the end and columns past K (or N) are zeros.
  auto load_tile = [&](int kt, int stage) {
    const int k0 = kt * kBK;
    const bool k_ok = k0 + chunk * 8 < K;
#pragma unroll
    for (int j = 0; j < kACopies; ++j) {
      if (form_x) break;
      const bool ok = k_ok && a_src[j] != nullptr;
      cp_async16(a_dst[j] + stage * kATileBytes, ok ? a_src[j] + k0 : x, ok);
    }
#pragma unroll
    for (int j = 0; j < kBCopies; ++j) {
      const bool ok = b_src[j] != nullptr && (kTransW ? k0 + b_row0 + j * kBRowStep < K : k0 + b_chunk * 8 < K);
      cp_async16(b_dst[j] + stage * kBTileBytes, ok ? b_src[j] + (kTransW ? int64_t(k0) * w_ld : k0) : w, ok);
    }
  };

  // The fragments' ldmatrix addresses. Every row a lane addresses is lane % 8 past a multiple of
  // 8, so its swizzle key is lane % 8 and an address is a row's start plus a chunk offset per
  // k16 step. A: matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15), lanes 0-15 the first k half. W:
  // two n8 fragments an ldmatrix, lanes 0-15 the first (k 0-7, then 8-15), 16-31 the second; W
  // transposed, the same four matrices read by rows of k with .trans: lanes 0-7 k 0-7, 8-15 k
  // 8-15, of the first n8 fragment's 8 columns (one chunk), 16-31 of the second's.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm0 = (warp / (BN / WN)) * WM, wn0 = (warp % (BN / WN)) * WN;
  const int key = lane & 7, a_half = lane >> 4, b_half = (lane >> 3) & 1;
  unsigned a_row[T::MI], b_addr[T::NI / 2];
#pragma unroll
  for (int mi = 0; mi < T::MI; ++mi) a_row[mi] = a_smem + (wm0 + mi * 16 + (lane & 15)) * (kBK * 2);
#pragma unroll
  for (int nj = 0; nj < T::NI / 2; ++nj)
    b_addr[nj] = kTransW ? b_smem + (key + b_half * 8) * kBRowBytes + ((((wn0 >> 3) + nj * 2 + a_half) ^ key) << 4)
                         : b_smem + (wn0 + nj * 16 + key + (a_half << 3)) * kBRowBytes;

  float acc[T::MI][T::NI][4] = {};
  const int tiles = (K + kBK - 1) / kBK;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < tiles) load_tile(s, s);
    cp_async_commit();
  }
  if (form_x) {  // while W's tile is in flight; the K loop's first barrier publishes it
    const bool store_x = n0 == 0;  // one column tile's blocks write x for the backward
#pragma unroll
    for (int j = 0; j < kACopies; ++j) {
      const int r = row0 + j * kRowStep, row = m0 + r;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (row < rows && chunk * 8 < K) {
        v = iqn_cosines8(P.fractions[row], chunk * 8);
        if (store_x) *reinterpret_cast<uint4*>(P.x_out + int64_t(row) * x_ld + chunk * 8) = v;
      }
      *reinterpret_cast<uint4*>(smem_raw + tile_offset(r, chunk)) = v;
    }
  }
  for (int kt = 0; kt < tiles; ++kt) {
    cp_async_wait<kStages - 2>();  // tile kt has landed (this thread's copies) ...
    __syncthreads();               // ... every thread's, and stage (kt - 1) % kStages is free
    if (kt + kStages - 1 < tiles) load_tile(kt + kStages - 1, (kt + kStages - 1) % kStages);
    cp_async_commit();
    const int stage = kt % kStages;
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      const unsigned a_off = stage * kATileBytes + (((kk * 2 + a_half) ^ key) << 4);
      const unsigned b_off = stage * kBTileBytes + (kTransW ? kk * 16 * kBRowBytes : ((kk * 2 + b_half) ^ key) << 4);
      unsigned af[T::MI][4], bf[T::NI][2];
#pragma unroll
      for (int mi = 0; mi < T::MI; ++mi) ldmatrix_x4(af[mi], a_row[mi] + a_off);
#pragma unroll
      for (int nj = 0; nj < T::NI / 2; ++nj) {
        unsigned r[4];
        if (kTransW)
          ldmatrix_x4_trans(r, b_addr[nj] + b_off);
        else
          ldmatrix_x4(r, b_addr[nj] + b_off);
        bf[2 * nj][0] = r[0];
        bf[2 * nj][1] = r[1];
        bf[2 * nj + 1][0] = r[2];
        bf[2 * nj + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < T::MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < T::NI; ++ni) mma_bf16_16816(acc[mi][ni], af[mi], bf[ni][0], bf[ni][1]);
    }
  }
  cp_async_wait<0>();  // nothing is left in flight (the last groups are empty)

  // Epilogue: a thread holds rows g and g + 8 of each m16 fragment, columns 2t and 2t + 1 of
  // each n8 fragment (g = lane / 4, t = lane % 4). N is even: col < N means col + 1 < N. The F32
  // pairs are stored by __stwb (an ordinary store): assigned through a float2 pointer, the front
  // end splits them into two 4-byte stores.
  const int g = lane >> 2, t2 = (lane & 3) * 2;
  auto row_of = [&](int mi, int h) { return m0 + wm0 + mi * 16 + g + h * 8; };
  auto col_of = [&](int ni) { return n0 + wn0 + ni * 8 + t2; };
  const int64_t out_ld = P.out_ld;
  float2 b[T::NI];
  if (kEpilogue == DenseEpilogue::kHidden) {
    const float* const bias = P.bias + out_at;
#pragma unroll
    for (int ni = 0; ni < T::NI; ++ni) {
      const int col = col_of(ni);
      b[ni] = col < N ? make_float2(bias[col], bias[col + 1]) : make_float2(0.f, 0.f);
    }
  }
  const __nv_bfloat16* const aux = P.aux ? P.aux + out_at : nullptr;
  __nv_bfloat16* const out_bf16 = P.out_bf16 ? P.out_bf16 + out_at : nullptr;
  // Null for a kInputGrad problem that keeps only the column sums of its F32 gradient.
  void* const out = P.out ? static_cast<char*>(P.out) + out_at * (kEpilogue == DenseEpilogue::kHidden ? 2 : 4)
                          : nullptr;
  // kInputGrad's mask pairs, all of a thread's copied to shared memory at once before any store:
  // read in the store loop itself, each load waited out a latency of its own (the stores before
  // it may alias it), 2 MI NI latencies of L2 or HBM a thread. Pair j of thread i is word j *
  // kThreads + i of the stages, whose last reads the barrier waits for (every block runs it or
  // not: the problem's aux is uniform). kHidden's scale (IQN's h_L[r / N]) stays loaded in the
  // loop: a tile's rows read a few rows of it, L1 hits, and staging it made IQN's phi launch
  // slower (bench/NOTES.md, the dense kernel's bullet "The epilogue's mask loads").
  constexpr int kPairs = T::MI * 2 * T::NI;
  static_assert(kPairs * T::kThreads * 4 <= T::kSmemBytes, "a thread's aux pairs fit the stages");
  const bool staged_aux = kEpilogue == DenseEpilogue::kInputGrad && aux != nullptr;
  const unsigned aux_smem = a_smem + threadIdx.x * 4;
  if (staged_aux) {
    __syncthreads();
#pragma unroll
    for (int mi = 0; mi < T::MI; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row_of(mi, h);
#pragma unroll
        for (int ni = 0; ni < T::NI; ++ni) {
          const int col = col_of(ni);
          const bool ok = row < rows && col < N;
          const int j = (mi * 2 + h) * T::NI + ni;
          cp_async4(aux_smem + j * T::kThreads * 4, ok ? aux + int64_t(row) * out_ld + col : aux, ok);
        }
      }
    cp_async_commit();
    cp_async_wait<0>();
  }
  auto aux_pair = [&](int mi, int h, int ni) {
    unsigned v;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(aux_smem + ((mi * 2 + h) * T::NI + ni) * T::kThreads * 4));
    return v;
  };
  // kStagedStores (launch_epilogue: as DQN_OPS_DENSE_STORES says, where every problem's output
  // rows are whole 16-byte chunks): the fragments' pairs go to shared memory first, then each
  // row leaves in 16-byte stores, where the direct path stores 4 (BF16) or 8 (F32) bytes a
  // thread, 8 rows x 16 or 32 bytes a warp's store.
  //   - kHidden: a [BM, BN + 8] BF16 tile of the free stages (a tile each for out and the scaled
  //     out_bf16), rows padded by 16 bytes so that a warp's 4-byte writes (8 rows, 4 pairs each)
  //     and the 16-byte reads of a row fall on distinct banks; BN / 8 threads a row.
  //   - kInputGrad: a [BM, BN] F32 tile after the mask pairs (the two fill the stages of the
  //     128 x 128 tile: no room for padding), chunk c of row r at chunk c ^ 2 (r % 8), so a warp's
  //     8-byte writes (8 rows, 32 bytes each) take two wavefronts and a row's 16-byte reads none
  //     extra; BN / 4 threads a row, each also storing its four values' BF16 copy to out_bf16
  //     (the same rounding as the direct path's).
  constexpr int kStagedLd = BN + 8;  // BF16 elements a staged row: 16 bytes of padding
  static_assert(2 * BM * kStagedLd * 2 <= T::kSmemBytes, "both staged output tiles fit the stages");
  constexpr int kPairBytes = kPairs * T::kThreads * 4;
  constexpr bool kStagedGrad = kStagedStores && kEpilogue == DenseEpilogue::kInputGrad;
  static_assert(!kStagedGrad || kPairBytes + BM * BN * 4 <= T::kSmemBytes,
                "the mask pairs and the staged gradient fit the stages");
  static_assert(!kStagedGrad || BN % 64 == 0, "the swizzle's XOR (bits 1-3 of a chunk) stays within a row");
  static_assert(!kStagedStores || kEpilogue != DenseEpilogue::kLogits, "kLogits stores directly");
  __nv_bfloat16* const out_tile = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  __nv_bfloat16* const z_tile = out_tile + BM * kStagedLd;
  float* const grad_tile = reinterpret_cast<float*>(smem_raw + kPairBytes);
  // Element (r, c) of the staged gradient (c even in the fragments' writes, a multiple of 4 in
  // the reads).
  auto grad_at = [](int r, int c) { return r * BN + ((((c >> 2) ^ ((r & 7) << 1))) << 2) + (c & 3); };
  // Every warp's last K tile read before the stages are written (the masks' staging above
  // already waited for it).
  if (kStagedStores && !staged_aux) __syncthreads();
#pragma unroll
  for (int mi = 0; mi < T::MI; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row_of(mi, h);
      if (row >= rows) continue;
      const int64_t at = int64_t(row) * out_ld;
      // rows <= INT_MAX (dense_applies), so IQN's row / scale_group is a 32-bit division a row.
      const __nv_bfloat16* const scale_row =
          kEpilogue == DenseEpilogue::kHidden && out_bf16
              ? aux + int64_t(row / static_cast<int>(l.scale_group)) * out_ld
              : nullptr;
#pragma unroll
      for (int ni = 0; ni < T::NI; ++ni) {
        const int col = col_of(ni);
        if (col >= N) continue;
        const float v0 = acc[mi][ni][2 * h], v1 = acc[mi][ni][2 * h + 1];
        if (kEpilogue == DenseEpilogue::kHidden) {
          const __nv_bfloat162 v = __floats2bfloat162_rn(relu_keep_nan(v0 + b[ni].x), relu_keep_nan(v1 + b[ni].y));
          const unsigned bits = *reinterpret_cast<const unsigned*>(&v);
          const unsigned scaled =
              scale_row ? bf16_product2(*reinterpret_cast<const unsigned*>(scale_row + col), bits) : 0u;
          if constexpr (kStagedStores) {
            const int at_tile = (row - m0) * kStagedLd + (col - n0);
            *reinterpret_cast<unsigned*>(out_tile + at_tile) = bits;
            if (scale_row) *reinterpret_cast<unsigned*>(z_tile + at_tile) = scaled;
          } else {
            *reinterpret_cast<unsigned*>(static_cast<__nv_bfloat16*>(out) + at + col) = bits;
            if (scale_row) *reinterpret_cast<unsigned*>(out_bf16 + at + col) = scaled;
          }
        } else if (kEpilogue == DenseEpilogue::kLogits) {
          __stwb(reinterpret_cast<float2*>(static_cast<float*>(out) + at + col), make_float2(v0, v1));
        } else {  // kInputGrad: the ReLU's gradient mask, as relu_backward applies it
          float2 d = make_float2(v0, v1);
          if (staged_aux) {
            const unsigned bits = aux_pair(mi, h, ni);
            const float2 m = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
            d = make_float2(relu_grad(m.x, d.x), relu_grad(m.y, d.y));
          }
          if constexpr (kStagedStores) {
            *reinterpret_cast<float2*>(grad_tile + grad_at(row - m0, col - n0)) = d;
          } else {
            __stwb(reinterpret_cast<float2*>(static_cast<float*>(out) + at + col), d);
            if (out_bf16) *reinterpret_cast<__nv_bfloat162*>(out_bf16 + at + col) = __floats2bfloat162_rn(d.x, d.y);
          }
        }
      }
    }
  if constexpr (kStagedStores) {
    __syncthreads();
    // A row's 16-byte chunks, of BF16 or of F32 (N a multiple of 8, the rows 16-byte aligned:
    // launch_epilogue).
    constexpr int kChunkCols = kEpilogue == DenseEpilogue::kHidden ? 8 : 4;
    constexpr int kRowChunks = BN / kChunkCols;
    for (int c = threadIdx.x; c < BM * kRowChunks; c += T::kThreads) {
      const int r = c / kRowChunks, col = n0 + (c % kRowChunks) * kChunkCols, row = m0 + r;
      if (row >= rows || col >= N) continue;
      const int64_t at = int64_t(row) * out_ld + col;
      if constexpr (kEpilogue == DenseEpilogue::kHidden) {
        const int at_tile = r * kStagedLd + (col - n0);
        *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(out) + at) =
            *reinterpret_cast<const uint4*>(out_tile + at_tile);
        if (out_bf16) *reinterpret_cast<uint4*>(out_bf16 + at) = *reinterpret_cast<const uint4*>(z_tile + at_tile);
      } else {
        const float4 d = *reinterpret_cast<const float4*>(grad_tile + grad_at(r, col - n0));
        // One 16-byte store; assigned through the float4 pointer, it would leave as four 4-byte ones.
        if (out) __stwb(reinterpret_cast<float4*>(static_cast<float*>(out) + at), d);
        if (out_bf16) {
          const __nv_bfloat162 lo = __floats2bfloat162_rn(d.x, d.y), hi = __floats2bfloat162_rn(d.z, d.w);
          *reinterpret_cast<uint2*>(out_bf16 + at) =
              make_uint2(*reinterpret_cast<const unsigned*>(&lo), *reinterpret_cast<const unsigned*>(&hi));
        }
      }
    }
    // kInputGrad's column sums (dense_layer.h, col_sums) from the staged tile, which the copy-out
    // above only read: two threads a column, each over one half of the tile's rows that exist,
    // row r into accumulator r % 4 (each half starts at a multiple of 4). Every (row tile, half,
    // column) of the problem is written, 0 for a half past the rows.
    if constexpr (kStagedGrad) {
      if (P.col_sums) {
        static_assert(T::kThreads == kColumnSumHalves * BN, "two threads a column");
        static_assert((BM / kColumnSumHalves) % 4 == 0, "a half's rows start at a multiple of 4");
        const int c = threadIdx.x % BN, half = threadIdx.x / BN, col = n0 + c;
        if (col < N) {
          const int begin = half * (BM / kColumnSumHalves);
          const int end = min(begin + BM / kColumnSumHalves, rows - m0);
          float a[4] = {0.f, 0.f, 0.f, 0.f};
          int r = begin;
          for (; r + 3 < end; r += 4)
#pragma unroll
            for (int u = 0; u < 4; ++u) a[u] += grad_tile[grad_at(r + u, c)];
#pragma unroll
          for (int u = 0; u < 3; ++u)
            if (r + u < end) a[u] += grad_tile[grad_at(r + u, c)];
          const int64_t sum_row = int64_t(m0 / BM) * kColumnSumHalves + half;
          P.col_sums[out_at + sum_row * out_ld + col] = (a[0] + a[1]) + (a[2] + a[3]);
        }
      }
    }
  }
}

enum class TileShape { k128x128, k64x64, k32x64, k128x16 };
constexpr int tile_rows(TileShape t) {
  return t == TileShape::k128x128 || t == TileShape::k128x16 ? 128 : t == TileShape::k64x64 ? 64 : 32;
}
constexpr int tile_cols(TileShape t) {
  return t == TileShape::k128x128 ? 128 : t == TileShape::k128x16 ? 16 : 64;
}
template <int BM, int BN>
constexpr TileShape shape_of() {
  return BN == 16    ? TileShape::k128x16
         : BM == 128 ? TileShape::k128x128
         : BM == 64  ? TileShape::k64x64
                     : TileShape::k32x64;
}
// The narrow tile's widest output: kLogits launches whose every problem is at most this wide take it.
constexpr int64_t kNarrowMaxN = 16;
// Mode auto's most rows a kLogits problem on the square tiles (measured_faster).
constexpr int64_t kLogitsMaxRows = 2048;
static_assert(tile_cols(TileShape::k128x16) == kNarrowMaxN, "the narrow tile covers a narrow problem's columns");
static_assert(tile_rows(TileShape::k32x64) == kDenseMinTileRows, "dense_layer.h's fewest tile rows");

int64_t tiles_of(const DenseProblem& p, TileShape t) {
  return p.batch * ((p.rows + tile_rows(t) - 1) / tile_rows(t)) * ((p.N + tile_cols(t) - 1) / tile_cols(t));
}
int64_t tiles_of(const DenseLaunch& l, TileShape t) {
  int64_t n = 0;
  for (int i = 0; i < l.count; ++i) n += tiles_of(l.problem[i], t);
  return n;
}

// DQN_OPS_DENSE_TILE (switches.h): unset or "auto" pick_tile's rule; "128x128", "64x64" or
// "32x64" that shape for every launch, the narrow output layers' too (the A/B switch for the
// rule; any shape gives the same bits). -1: auto.
int forced_tile() {
  static constexpr SwitchName kNames[] = {{"auto", -1},
                                          {"128x128", static_cast<int>(TileShape::k128x128)},
                                          {"64x64", static_cast<int>(TileShape::k64x64)},
                                          {"32x64", static_cast<int>(TileShape::k32x64)}};
  static const int forced = env_switch("DQN_OPS_DENSE_TILE", kNames, -1);
  return forced;
}

// DQN_OPS_DENSE_STORES (switches.h): which epilogues store through shared memory in 16-byte
// stores, in the launches whose rows are whole 16-byte chunks (rows_in_chunks; the others store
// their pairs from the fragments): unset or "all", kHidden's and kInputGrad's (each measured
// faster: bench/NOTES.md, the dense kernel's bullets "The staged stores" and "The input
// gradients' stores staged"); "hidden", kHidden's alone; "direct", none. Any of them gives the
// same bits.
enum class StagedStores { kNone, kHidden, kAll };
StagedStores staged_stores() {
  static constexpr SwitchName kNames[] = {{"direct", static_cast<int>(StagedStores::kNone)},
                                          {"hidden", static_cast<int>(StagedStores::kHidden)},
                                          {"all", static_cast<int>(StagedStores::kAll)}};
  static const auto staged =
      static_cast<StagedStores>(env_switch("DQN_OPS_DENSE_STORES", kNames, static_cast<int>(StagedStores::kAll)));
  return staged;
}
bool stages_stores(DenseEpilogue e) {
  return e == DenseEpilogue::kHidden ? staged_stores() != StagedStores::kNone
                                     : e == DenseEpilogue::kInputGrad && staged_stores() == StagedStores::kAll;
}

// DQN_OPS_NARROW_LOGITS (switches.h): "1" the narrow tile and its rows in mode auto's rule
// (measured_faster), "0" neither (output layers of narrow heads then run as any other: cuBLAS's
// GEMMs past kLogitsMaxRows). Unset: "0", until an A/B on a GPU has timed it (bench/NOTES.md).
bool narrow_tile_enabled() {
  static const bool enabled = env_flag("DQN_OPS_NARROW_LOGITS", false);
  return enabled;
}

// Whether every problem of a kLogits launch is at most kNarrowMaxN columns wide (and the narrow
// tile is enabled).
bool narrow_logits(const DenseLaunch& l) {
  if (l.epilogue != DenseEpilogue::kLogits || !narrow_tile_enabled()) return false;
  for (int i = 0; i < l.count; ++i)
    if (l.problem[i].N > kNarrowMaxN) return false;
  return true;
}

// Whether a problem of `l` has more rows than mode auto takes on the square tiles.
bool past_square_rows(const DenseLaunch& l) {
  for (int i = 0; i < l.count; ++i)
    if (l.problem[i].rows > kLogitsMaxRows) return true;
  return false;
}

// The narrow tile for a narrow output layer whose grid covers every SM, or that mode auto takes
// for its narrowness alone (rows past kLogitsMaxRows: the shape it was timed on); else the
// largest tile whose grid still covers every SM, the smallest where none does.
TileShape pick_tile(const DenseLaunch& l) {
  if (forced_tile() >= 0) return static_cast<TileShape>(forced_tile());
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  if (narrow_logits(l) && (tiles_of(l, TileShape::k128x16) >= sms || past_square_rows(l)))
    return TileShape::k128x16;
  for (TileShape t : {TileShape::k128x128, TileShape::k64x64})
    if (tiles_of(l, t) >= sms) return t;
  return TileShape::k32x64;
}

template <int BM, int BN, int WM, int WN, DenseEpilogue kEpilogue, bool kStagedStores>
int launch_tile(DenseLaunch& l, cudaStream_t stream) {
  using T = Tile<BM, BN, WM, WN>;
  auto* kernel = dense_layer_kernel<BM, BN, WM, WN, kEpilogue, kStagedStores>;
  if (T::kSmemBytes > 48 * 1024) opt_in_dynamic_smem(kernel);
  constexpr TileShape shape = shape_of<BM, BN>();
  l.first_tile[0] = 0;
  for (int i = 0; i < l.count; ++i)
    l.first_tile[i + 1] = l.first_tile[i] + static_cast<int>(tiles_of(l.problem[i], shape));
  launch(kernel, dim3(static_cast<unsigned>(l.first_tile[l.count])), dim3(T::kThreads), T::kSmemBytes, stream, l);
  return BM;
}

template <DenseEpilogue kEpilogue, bool kStagedStores>
int launch_tile_shape(DenseLaunch& l, cudaStream_t stream) {
  switch (pick_tile(l)) {
    case TileShape::k128x128: return launch_tile<128, 128, 64, 32, kEpilogue, kStagedStores>(l, stream);
    case TileShape::k64x64: return launch_tile<64, 64, 32, 32, kEpilogue, kStagedStores>(l, stream);
    case TileShape::k32x64: return launch_tile<32, 64, 16, 32, kEpilogue, kStagedStores>(l, stream);
    case TileShape::k128x16:  // pick_tile's for kLogits alone
      if constexpr (kEpilogue == DenseEpilogue::kLogits)
        return launch_tile<128, 16, 32, 16, kEpilogue, kStagedStores>(l, stream);
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "dense_layer_kernel: no tile for this launch");
  return 0;
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Whether every problem's output rows are whole 16-byte chunks of BF16 (the staged stores': 16
// bytes of BF16, or of F32 with its 8-byte BF16 copy): N, the row stride and the batch stride
// multiples of 8, out and out_bf16 16-byte aligned.
bool rows_in_chunks(const DenseLaunch& l) {
  for (int i = 0; i < l.count; ++i) {
    const DenseProblem& p = l.problem[i];
    if (p.N % 8 || p.out_ld % 8 || p.out_stride % 8 || !aligned(p.out, 16) || !aligned(p.out_bf16, 16)) return false;
  }
  return true;
}

// Whether `l` stages its stores through shared memory (as dense_layer_kernel's kStagedStores).
bool stages(const DenseLaunch& l) {
  return l.epilogue != DenseEpilogue::kLogits && stages_stores(l.epilogue) && rows_in_chunks(l);
}

template <DenseEpilogue kEpilogue>
int launch_epilogue(DenseLaunch& l, cudaStream_t stream) {
  if constexpr (kEpilogue != DenseEpilogue::kLogits)
    if (stages(l)) return launch_tile_shape<kEpilogue, true>(l, stream);
  return launch_tile_shape<kEpilogue, false>(l, stream);
}

// Mode auto's rule (bench/NOTES.md, "The dense layer kernel"). It reads each problem's shape and
// rows, not the launch's: the trainer's batched pass over both networks and a pass of one network
// then take the same kernel (output_logits_into launches a network alone where the pair's launch
// does not apply), so their outputs stay the same bits.
//   - kHidden: outputs of at least 128 columns, any rows. It was measured faster than the cuBLAS
//     GEMM and the bias + ReLU pass in every network step timed whose layers are that wide (the
//     reference network, the 3 x 512 trunk, IQN; at B = 256 and 4096), and a wash on the one with
//     a narrower layer (CleanRL's 88 units: slower at B = 256, faster at 4096).
//   - kLogits: at most kLogitsMaxRows rows a problem, or at most kNarrowMaxN columns. It saves
//     launches (a GEMM per head group and network, the target's fork and join), which counts at
//     small batches; at large ones cuBLAS's GEMMs are faster than this kernel's square tiles.
//     Measured with every kind on: faster at B = 256 and 1024 (the online network's 2048 rows),
//     slower at 2048 and 4096. Under DQN_OPS_NARROW_LOGITS, heads of at most kNarrowMaxN columns
//     (one atom) take the kernel at any rows, past kLogitsMaxRows on the narrow tile (pick_tile):
//     one launch for every head, reading their input once at the memory's rate, where cuBLAS ran
//     a GEMM per head group (IQN's 131,072 and 262,144 rows x 8 columns: bench/NOTES.md, the dense
//     kernel's bullet "The narrow output tile").
//   - kInputGrad: at most kInputGradMaxMacs products a problem (rows x N x K, x batch), or K within
//     one tile at any size. It saves the relu_backward pass after each GEMM; on larger GEMMs
//     cuBLAS's faster one wins more than the pass costs. Measured with every kind on, by each
//     step's largest such problem (the heads' merged first layer, the trunk's layers): faster at
//     2^25 to 2^27 (the reference at B = 256 and 1024, the 3 x 512 trunk at 256), slower at 2^28
//     and more (the reference at 2048, the trunk at 1024 and 2048). Where K fits one tile (the
//     output layer of few columns, IQN's atoms = 1 heads) the GEMM is no work beside writing dX,
//     and the kernel writes it once with its mask and copy where cuBLAS's path writes and rereads
//     it: measured faster at IQN's B = 4096 (131,072 rows x 512 x 8), the same at 256.
constexpr int64_t kInputGradMaxMacs = int64_t(1) << 27;
// rows x N x K x batch <= bound, without the product's overflow (floor divisions compose).
bool macs_at_most(const DenseProblem& p, int64_t bound) {
  return p.N > 0 && p.K > 0 && p.batch > 0 && p.rows <= bound / p.N / p.K / p.batch;
}
bool measured_faster(const DenseLaunch& l) {
  for (int i = 0; i < l.count; ++i) {
    const DenseProblem& p = l.problem[i];
    const bool faster = l.epilogue == DenseEpilogue::kHidden   ? p.N >= 128
                        : l.epilogue == DenseEpilogue::kLogits
                            ? p.rows <= kLogitsMaxRows || (p.N <= kNarrowMaxN && narrow_tile_enabled())
                            : p.K <= kBK || macs_at_most(p, kInputGradMaxMacs);
    if (!faster) return false;
  }
  return true;
}

bool problem_fits(const DenseProblem& p, DenseEpilogue e) {
  const bool trans = e == DenseEpilogue::kInputGrad;
  const uintptr_t out_bytes = e == DenseEpilogue::kHidden ? 4 : 8;  // a BF16 or an F32 pair
  // rows, N and K within int with a tile to spare: the kernel's row, column and k indices are ints.
  const bool sizes = p.rows > 0 && p.N > 0 && p.K > 0 && p.batch > 0 && p.rows <= INT_MAX - 128 &&
                     p.N <= INT_MAX - 128 && p.K <= INT_MAX - 128 && p.N % 2 == 0 && p.K % 8 == 0 &&
                     (!trans || p.N % 8 == 0) && p.out_ld % 2 == 0 && p.out_ld >= p.N && p.x_ld >= p.K &&
                     p.w_ld >= (trans ? p.N : p.K);
  const bool strides = p.batch == 1 || (p.x_stride % 8 == 0 && p.w_stride % 8 == 0 && p.out_stride % 2 == 0 &&
                                        p.x_stride >= 0 && p.w_stride >= 0 && p.out_stride > 0);
  // kInputGrad may keep only the column sums of its F32 gradient (out null); they need its mask
  // and BF16 copy (what mixed_backward reads on), and the staged stores (dense_applies).
  const bool sums_only = p.col_sums != nullptr;
  const bool operands = p.x && p.w && (p.out || sums_only) && aligned(p.x, 16) && aligned(p.w, 16) &&
                        p.x_ld % 8 == 0 && p.w_ld % 8 == 0 && aligned(p.out, out_bytes);
  const bool sums = !sums_only || (trans && p.aux && p.out_bf16 && aligned(p.col_sums, 4));
  // A formed x: kHidden's, one K tile, written 16 bytes at a time (x_ld % 8 == 0 above).
  const bool formed = p.fractions == nullptr || (e == DenseEpilogue::kHidden && p.K <= kBK && p.batch == 1 &&
                                                 p.x_out && aligned(p.x_out, 16) && aligned(p.fractions, 4));
  const bool extras = (e != DenseEpilogue::kHidden || p.bias != nullptr) && (p.aux == nullptr || aligned(p.aux, 4)) &&
                      (p.out_bf16 == nullptr || aligned(p.out_bf16, 4)) &&
                      (e != DenseEpilogue::kHidden || (p.out_bf16 == nullptr) == (p.aux == nullptr));
  return sizes && strides && operands && extras && sums && formed;
}

}  // namespace

bool dense_applies(const DenseLaunch& l) {
  const DenseLayerMode mode = dense_layer_mode();
  if (mode == DenseLayerMode::kOff || (mode == DenseLayerMode::kAuto && !measured_faster(l))) return false;
  if (at::cuda::getCurrentDeviceProperties()->major < 8) return false;  // mma.sync on BF16, cp.async
  if (l.count < 1 || l.count > DenseLaunch::kMaxProblems) return false;
  bool scaled = false, col_sums = false;
  for (int i = 0; i < l.count; ++i) {
    if (!problem_fits(l.problem[i], l.epilogue)) return false;
    scaled = scaled || (l.epilogue == DenseEpilogue::kHidden && l.problem[i].out_bf16 != nullptr);
    col_sums = col_sums || l.problem[i].col_sums != nullptr;
  }
  if (scaled && (l.count != 1 || l.problem[0].batch != 1 || l.scale_group < 1 || l.scale_group > INT_MAX))
    return false;
  if (col_sums && !stages(l)) return false;  // the sums read the staged tile
  // The grid's x dimension holds every problem's tiles; the smallest tile makes the most.
  return tiles_of(l, TileShape::k32x64) <= INT_MAX;
}

int dense_launch(DenseLaunch l, cudaStream_t stream) {
  switch (l.epilogue) {
    case DenseEpilogue::kHidden: return launch_epilogue<DenseEpilogue::kHidden>(l, stream);
    case DenseEpilogue::kLogits: return launch_epilogue<DenseEpilogue::kLogits>(l, stream);
    case DenseEpilogue::kInputGrad: return launch_epilogue<DenseEpilogue::kInputGrad>(l, stream);
  }
  return 0;  // unreachable: every epilogue is a case
}

}  // namespace cuda
}  // namespace dqn_ops
