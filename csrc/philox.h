// Counter-based random numbers shared by the CPU and CUDA kernels: Philox4x32-10 (Salmon et
// al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011; the generator of Random123,
// curand and torch). A draw is a pure function of (key, counter), so a kernel thread makes its
// own numbers without state, both backends make the same bits, and a graph replay draws new
// numbers when the counter lives in a device tensor that the op advances.
//
// The stream layout every dqn_ops op uses (tests/reference.py has the same in Python):
//   key     = the 64-bit seed (low word, high word)
//   counter = (row, stream << 16 | slot / 4, call low word, call high word); the draw is word slot % 4
// where `stream` says which op draws (Stream below), `call` is the op's device-side call
// counter, `row` the sample / environment and `slot` which number of that row (e.g. 0 =
// explore?, 1 + d = branch d's random action; below 2^18). The streams make the draws of
// different ops disjoint by construction: an env and an actor given the same seed (the easy
// thing to do) would otherwise draw the same numbers at the same step and row.
// bootstrap_masks keys its draws by the transition, not by a call: its `call` word is the
// replay index and its `row` the ensemble member (csrc/bootstrap_args.h).
// iqn_fractions draws two sets per row, tau at slots [0, 2^17) and tau' at [2^17, 2^18), so
// that each set's numbers do not depend on the other's size (csrc/iqn_fractions_args.h).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DQN_OPS_HD __host__ __device__ __forceinline__
#else
#define DQN_OPS_HD inline
#endif

namespace dqn_ops {
namespace philox {

struct Words {
  uint32_t w[4];
};

DQN_OPS_HD uint32_t mulhilo(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
}

// Philox4x32 with 10 rounds.
DQN_OPS_HD Words philox4x32_10(Words ctr, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = mulhilo(kM0, ctr.w[0], &hi0);
    const uint32_t lo1 = mulhilo(kM1, ctr.w[2], &hi1);
    ctr = Words{{hi1 ^ ctr.w[1] ^ k0, lo1, hi0 ^ ctr.w[3] ^ k1, lo0}};
    k0 += kW0;
    k1 += kW1;
  }
  return ctr;
}

// Which op draws: the high half of the counter's second word.
enum class Stream : uint32_t { kAct = 1, kReplay = 2, kEnv = 3, kBootstrap = 4, kIqnFractions = 5 };

// Word `slot % 4` of the block for (seed, call, row, stream, slot / 4).
DQN_OPS_HD uint32_t draw(Stream stream, uint64_t seed, uint64_t call, uint32_t row, uint32_t slot) {
  const Words out = philox4x32_10(
      Words{{row, (static_cast<uint32_t>(stream) << 16) | (slot / 4u), static_cast<uint32_t>(call),
             static_cast<uint32_t>(call >> 32)}},
      static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return out.w[slot % 4u];
}

// A uniform float in [0, 1): the top 24 bits, exact in F32.
DQN_OPS_HD float uniform(uint32_t bits) { return static_cast<float>(bits >> 8) * (1.0f / 16777216.0f); }

// An integer in [0, n) from a uniform draw (n >= 1); min() guards the rounding at the top.
DQN_OPS_HD int64_t below(uint32_t bits, int64_t n) {
  const int64_t i = static_cast<int64_t>(uniform(bits) * static_cast<float>(n));
  return i < n - 1 ? i : n - 1;
}

// An integer in [0, n) for any 1 <= n < 2^32: floor(bits * n / 2^32) by a 32x32 -> 64-bit
// multiply-shift (Lemire). below() goes through a 24-bit float and reaches at most 2^24
// distinct values, not every row of a 10M-row buffer; this reaches all of them, each with
// floor or ceil of 2^32 / n preimages (a relative bias below n / 2^32).
DQN_OPS_HD int64_t index_below(uint32_t bits, uint32_t n) {
  return static_cast<int64_t>((static_cast<uint64_t>(bits) * static_cast<uint64_t>(n)) >> 32);
}

}  // namespace philox
}  // namespace dqn_ops
