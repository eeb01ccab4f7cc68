// The dense hidden layer kernel (dense_layer.h): a BF16 tensor-core GEMM (mma.sync m16n8k16,
// F32 accumulators) whose epilogue adds the F32 bias, applies ReLU and rounds to BF16.
//
// A block computes a BM x BN tile of one network's output; its warps a WM x WN part each. The
// K dimension runs in tiles of kBK = 64, kStages of them in flight: each tile of x and of W is
// copied global -> shared by cp.async, 16 bytes a copy (zero-filled past the rows, N or K), and
// read into fragments by ldmatrix. A tile's shared rows are 128 bytes, eight 16-byte chunks;
// chunk c of row r is stored at chunk c ^ (r % 8), so the 8 rows an ldmatrix reads (8
// consecutive rows, one chunk) fall on 8 different chunks of the banks (no conflicts), as do a
// warp's copies (4 rows, 8 chunks each).
//
// Tile shapes (pick_tile): 128 x 128 with 8 warps for large layers, 64 x 64 and 32 x 64 with 4
// warps where the larger tile would leave SMs idle. Every shape accumulates an element's
// products in the same order (k16 steps from 0), so the choice does not change any bit.
#include "dense_layer.h"

#include <climits>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>

#include "../dense_layer_mode.h"
#include "elementwise.cuh"
#include "pdl.cuh"
#include "smem_limit.h"

namespace dqn_ops {
namespace cuda {
namespace {

constexpr int kBK = 64;           // K elements of a tile: 128 bytes a row
constexpr int kChunks = kBK / 8;  // 16-byte chunks a row
constexpr int kStages = 3;        // K tiles in flight

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; with `valid` false the 16 bytes are zeros (nothing is read).
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
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
  static constexpr int kWarps = (BM / WM) * (BN / WN);
  static constexpr int kThreads = kWarps * 32;
  static constexpr int MI = WM / 16;  // m16 fragments a warp
  static constexpr int NI = WN / 8;   // n8 fragments a warp
  static constexpr size_t kSmemBytes = size_t(kStages) * (BM + BN) * kBK * sizeof(__nv_bfloat16);
  static_assert(BM % WM == 0 && BN % WN == 0 && WM % 16 == 0 && WN % 16 == 0, "tile shape");
};

template <int BM, int BN, int WM, int WN>
__global__ void __launch_bounds__(Tile<BM, BN, WM, WN>::kThreads)
    dense_layer_kernel(DenseLayerArgs a) {
  using T = Tile<BM, BN, WM, WN>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  pdl_enter();

  const int net = blockIdx.z;
  const int64_t rows = a.rows, m0 = int64_t(blockIdx.y) * BM;
  const int N = static_cast<int>(a.N), K = static_cast<int>(a.K), n0 = blockIdx.x * BN;
  const __nv_bfloat16* const x = a.x + net * a.x_net_stride;
  const __nv_bfloat16* const w = a.w + net * a.w_net_stride;
  const float* const bias = net == 0 ? a.bias_lo : a.bias_hi;
  __nv_bfloat16* const out = a.out + net * a.out_net_stride;

  // Shared memory: kStages tiles of x's rows ([BM, kBK] each), then kStages of W's ([BN, kBK]).
  constexpr unsigned kATileBytes = BM * kBK * 2, kBTileBytes = BN * kBK * 2;
  const unsigned a_smem = smem_addr(smem_raw), b_smem = a_smem + kStages * kATileBytes;

  // The copies: a thread takes chunk threadIdx.x % kChunks of rows threadIdx.x / kChunks + j *
  // kRowStep, the same rows and chunk every K tile, so their sources and destinations are found once.
  constexpr int kRowStep = T::kThreads / kChunks, kACopies = BM / kRowStep, kBCopies = BN / kRowStep;
  static_assert(BM % kRowStep == 0 && BN % kRowStep == 0, "a tile's rows split evenly over the threads");
  const int chunk = threadIdx.x % kChunks, row0 = threadIdx.x / kChunks;
  const __nv_bfloat16* a_src[kACopies];
  const __nv_bfloat16* b_src[kBCopies];
  unsigned a_dst[kACopies], b_dst[kBCopies];
#pragma unroll
  for (int j = 0; j < kACopies; ++j) {
    const int r = row0 + j * kRowStep;
    a_src[j] = m0 + r < rows ? x + (m0 + r) * K + chunk * 8 : nullptr;
    a_dst[j] = a_smem + tile_offset(r, chunk);
  }
#pragma unroll
  for (int j = 0; j < kBCopies; ++j) {
    const int r = row0 + j * kRowStep;
    b_src[j] = n0 + r < N ? w + int64_t(n0 + r) * K + chunk * 8 : nullptr;
    b_dst[j] = b_smem + tile_offset(r, chunk);
  }
  // K tile kt into stage `stage`; rows past the end and columns past K are zeros.
  auto load_tile = [&](int kt, int stage) {
    const int k0 = kt * kBK;
    const bool k_ok = k0 + chunk * 8 < K;
#pragma unroll
    for (int j = 0; j < kACopies; ++j) {
      const bool ok = k_ok && a_src[j] != nullptr;
      cp_async16(a_dst[j] + stage * kATileBytes, ok ? a_src[j] + k0 : x, ok);
    }
#pragma unroll
    for (int j = 0; j < kBCopies; ++j) {
      const bool ok = k_ok && b_src[j] != nullptr;
      cp_async16(b_dst[j] + stage * kBTileBytes, ok ? b_src[j] + k0 : w, ok);
    }
  };

  // The fragments' ldmatrix addresses. Every row a lane addresses is lane % 8 past a multiple of
  // 8, so its swizzle key is lane % 8 and an address is a row's start plus a chunk offset per
  // k16 step. A: matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15), lanes 0-15 the first k half. W:
  // two n8 fragments an ldmatrix, lanes 0-15 the first (k 0-7, then 8-15), 16-31 the second.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm0 = (warp / (BN / WN)) * WM, wn0 = (warp % (BN / WN)) * WN;
  unsigned a_row[T::MI], b_row[T::NI / 2];
#pragma unroll
  for (int mi = 0; mi < T::MI; ++mi) a_row[mi] = a_smem + (wm0 + mi * 16 + (lane & 15)) * (kBK * 2);
#pragma unroll
  for (int nj = 0; nj < T::NI / 2; ++nj)
    b_row[nj] = b_smem + (wn0 + nj * 16 + (lane & 7) + ((lane >> 4) << 3)) * (kBK * 2);
  const int key = lane & 7, a_half = lane >> 4, b_half = (lane >> 3) & 1;

  float acc[T::MI][T::NI][4] = {};
  const int tiles = (K + kBK - 1) / kBK;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < tiles) load_tile(s, s);
    cp_async_commit();
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
      const unsigned b_off = stage * kBTileBytes + (((kk * 2 + b_half) ^ key) << 4);
      unsigned af[T::MI][4], bf[T::NI][2];
#pragma unroll
      for (int mi = 0; mi < T::MI; ++mi) ldmatrix_x4(af[mi], a_row[mi] + a_off);
#pragma unroll
      for (int nj = 0; nj < T::NI / 2; ++nj) {
        unsigned r[4];
        ldmatrix_x4(r, b_row[nj] + b_off);
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
  // each n8 fragment (g = lane / 4, t = lane % 4).
  const int g = lane >> 2, t2 = (lane & 3) * 2;
  float2 b[T::NI];
#pragma unroll
  for (int ni = 0; ni < T::NI; ++ni) {
    const int col = n0 + wn0 + ni * 8 + t2;
    b[ni] = col < N ? make_float2(bias[col], bias[col + 1]) : make_float2(0.f, 0.f);  // N even: col + 1 < N
  }
#pragma unroll
  for (int mi = 0; mi < T::MI; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // int: the grid has at most 65535 row tiles (dense_layer_applies), so rows < 2^31.
      const int row = static_cast<int>(m0) + wm0 + mi * 16 + g + h * 8;
      if (row >= rows) continue;
      __nv_bfloat16* const out_row = out + int64_t(row) * N;
      const __nv_bfloat16* const scale_row =
          a.scaled_out ? a.scale + int64_t(row / static_cast<int>(a.scale_group)) * N : nullptr;
#pragma unroll
      for (int ni = 0; ni < T::NI; ++ni) {
        const int col = n0 + wn0 + ni * 8 + t2;
        if (col >= N) continue;
        const __nv_bfloat162 v = __floats2bfloat162_rn(relu_keep_nan(acc[mi][ni][2 * h] + b[ni].x),
                                                       relu_keep_nan(acc[mi][ni][2 * h + 1] + b[ni].y));
        const unsigned bits = *reinterpret_cast<const unsigned*>(&v);
        *reinterpret_cast<unsigned*>(out_row + col) = bits;
        if (scale_row) {
          const unsigned s = *reinterpret_cast<const unsigned*>(scale_row + col);
          *reinterpret_cast<unsigned*>(a.scaled_out + int64_t(row) * N + col) = bf16_product2(s, bits);
        }
      }
    }
}

enum class TileShape { k128x128, k64x64, k32x64 };
constexpr int tile_rows(TileShape t) { return t == TileShape::k128x128 ? 128 : t == TileShape::k64x64 ? 64 : 32; }
constexpr int tile_cols(TileShape t) { return t == TileShape::k128x128 ? 128 : 64; }

int64_t blocks_of(const DenseLayerArgs& a, TileShape t) {
  return (a.rows + tile_rows(t) - 1) / tile_rows(t) * ((a.N + tile_cols(t) - 1) / tile_cols(t)) * a.nets;
}

// The largest tile whose grid still covers every SM; the smallest where none does.
TileShape pick_tile(const DenseLayerArgs& a) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  for (TileShape t : {TileShape::k128x128, TileShape::k64x64})
    if (blocks_of(a, t) >= sms) return t;
  return TileShape::k32x64;
}

template <int BM, int BN, int WM, int WN>
void launch_tile(const DenseLayerArgs& a, cudaStream_t stream) {
  using T = Tile<BM, BN, WM, WN>;
  auto* kernel = dense_layer_kernel<BM, BN, WM, WN>;
  if (T::kSmemBytes > 48 * 1024) opt_in_dynamic_smem(kernel);
  // N tiles along x: the blocks that read one tile of x's rows run one after the other.
  const dim3 grid(static_cast<unsigned>((a.N + BN - 1) / BN), static_cast<unsigned>((a.rows + BM - 1) / BM),
                  static_cast<unsigned>(a.nets));
  launch(kernel, grid, dim3(T::kThreads), T::kSmemBytes, stream, a);
}

// Mode auto's rule (bench/NOTES.md, "The dense layer kernel"): the kernel for outputs of at least
// 128 columns. It was measured faster than the cuBLAS GEMM and the bias + ReLU pass in every
// network step timed whose layers are that wide (the reference network, the 3 x 512 trunk, IQN;
// at B = 256 and 4096), and a wash on the one with a narrower layer (CleanRL's 88 units: slower
// at B = 256, faster at 4096). The rule reads the layer's shape only, not its rows: the trainer's
// batched pass over both networks and a pass of one network then take the same kernel, so their
// outputs stay the same bits.
bool measured_faster(const DenseLayerArgs& a) { return a.N >= 128; }

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

bool dense_layer_applies(const DenseLayerArgs& a) {
  const DenseLayerMode mode = dense_layer_mode();
  if (mode == DenseLayerMode::kOff || (mode == DenseLayerMode::kAuto && !measured_faster(a))) return false;
  if (at::cuda::getCurrentDeviceProperties()->major < 8) return false;  // mma.sync on BF16, cp.async
  const bool two = a.nets == 2;
  // N and K within int with a tile to spare: the kernel's column and k indices are ints.
  const bool shapes = (a.nets == 1 || two) && a.rows > 0 && a.N > 0 && a.K > 0 && a.N % 2 == 0 && a.K % 8 == 0 &&
                      a.N <= INT_MAX - 128 && a.K <= INT_MAX - 128;
  const bool strides = !two || (a.x_net_stride % 8 == 0 && a.w_net_stride % 8 == 0 && a.out_net_stride % 2 == 0);
  const bool scaled = a.scaled_out == nullptr || (a.nets == 1 && a.scale != nullptr && a.scale_group > 0 &&
                                                   a.scale_group <= INT_MAX && aligned(a.scale, 4) &&
                                                   aligned(a.scaled_out, 4));
  if (!(shapes && strides && scaled && aligned(a.x, 16) && aligned(a.w, 16) && aligned(a.out, 4))) return false;
  // The grid's y dimension holds the row tiles. It bounds rows by 65535 tiles (8.4M rows at the
  // 128-row tile, which any layer of more than ~17k rows takes), which the trainer's batched pass
  // (at most 2 x 4096 rows a network) never meets, so the batched pass and a pass of one network
  // take the same path.
  const int64_t rows_per_tile = tile_rows(pick_tile(a));
  return (a.rows + rows_per_tile - 1) / rows_per_tile <= 65535;
}

void dense_layer(const DenseLayerArgs& a, cudaStream_t stream) {
  switch (pick_tile(a)) {
    case TileShape::k128x128: return launch_tile<128, 128, 64, 32>(a, stream);
    case TileShape::k64x64: return launch_tile<64, 64, 32, 32>(a, stream);
    case TileShape::k32x64: return launch_tile<32, 64, 16, 32>(a, stream);
  }
}

}  // namespace cuda
}  // namespace dqn_ops
