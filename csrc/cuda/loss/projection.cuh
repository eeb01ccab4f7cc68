// The C51 projection of the target distribution onto the support (loss.cu's parts: see
// loss.cu): where source atom i's return r + gamma z_i lands (pos[i], in atoms) splits its
// probability pt[i] between the atoms below and above. Two ways to sum the masses per atom:
// projected_mass (the general version: each atom gathers its sources, found by binary search)
// and project_by_runs (atoms <= 128, the register version's: a segmented scan over one warp).
#pragma once

#include <climits>

namespace dqn_ops {
namespace cuda {
namespace {  // see loss/params.cuh

// First index i in [0, n) with pos[i] >= x (ascending pos) or pos[i] <= x (descending).
__device__ int first_reaching(const float* pos, int n, float x, bool ascending) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (ascending ? pos[mid] < x : pos[mid] > x) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// The projected target mass of atom j: atom j receives mass only from sources with pos in
// [j - 1, j + 1] (its floor or ceiling is j), a contiguous range since pos is monotone in i
// (increasing, or constant for a terminal transition); the range's sources are added in
// increasing i, as a scan over every source would add them.
__device__ float projected_mass(const float* pt, const float* pos, int NA, int j, bool ascending) {
  float mj = 0.f;
  for (int i = first_reaching(pos, NA, ascending ? j - 1.f : j + 1.f, ascending); i < NA; ++i) {
    const float bi = pos[i];
    if (ascending ? bi > j + 1.f : bi < j - 1.f) break;
    float l = floorf(bi), u = ceilf(bi);
    if (l == u) {  // lands exactly on an atom: all its mass goes there
      if (u > 0.f) l -= 1.f;
      else u += 1.f;
    }
    if (int(l) == j) mj = fmaf(pt[i], u - bi, mj);
    if (int(u) == j) mj = fmaf(pt[i], bi - l, mj);
  }
  return mj;
}

// The projection for atoms <= 32 * kSlots, by one warp. Source i splits its probability between
// its lower atom l_i and l_i + 1 (pt_i (u - b_i) and pt_i (b_i - l_i); u = l + 1 always, the
// exact-landing case included). l_i is monotone in i, so the sources sharing a lower atom form
// one run: a segmented scan over the warp (lane L holds sources kSlots L ... kSlots L +
// kSlots - 1) sums every run, and each run's last source writes its two sums, lower[l] and
// upper[l] (zeroed before); atom j then receives lower[j] + upper[j - 1]. Within a lane a run's
// sources are added in order; the lane's last run joins the scan, and a run that ends inside
// the lane adds the scan's total of the lanes before it when it began at the lane's first
// source. Every lane runs the same few steps however long the runs are: the gather
// (projected_mass) looped over all the sources on one lane for a terminal transition (one run)
// and for long runs clipped at v_min / v_max. A fixed tree order: deterministic.
template <int kSlots>
__device__ void project_by_runs(const float* pt, const float* pos, float* lower, float* upper, int NA, int lane) {
  constexpr int kNone = INT_MAX;  // no source (past the last atom)
  constexpr unsigned kAll = 0xffffffffu;
  int key[kSlots];
  float cl[kSlots], cu[kSlots];
#pragma unroll
  for (int e = 0; e < kSlots; ++e) {
    const int i = kSlots * lane + e;
    key[e] = kNone;
    cl[e] = cu[e] = 0.f;
    if (i < NA) {
      const float bi = pos[i];
      float l = floorf(bi), u = ceilf(bi);
      if (l == u) {  // lands exactly on an atom: all its mass goes there
        if (u > 0.f) l -= 1.f;
        else u += 1.f;
      }
      key[e] = int(l);
      cl[e] = pt[i] * (u - bi);
      cu[e] = pt[i] * (bi - l);
    }
  }
  // Each source's run within the lane, summed up to it in order (rl, ru), and whether that run
  // began at the lane's first source (from_first).
  float rl[kSlots], ru[kSlots];
  bool from_first[kSlots];
  rl[0] = cl[0];
  ru[0] = cu[0];
  from_first[0] = true;
#pragma unroll
  for (int e = 1; e < kSlots; ++e) {
    const bool continues = key[e] == key[e - 1];
    rl[e] = continues ? rl[e - 1] + cl[e] : cl[e];
    ru[e] = continues ? ru[e - 1] + cu[e] : cu[e];
    from_first[e] = continues && from_first[e - 1];
  }
  // The lane's last run: an inclusive segmented scan keyed by its key (equal keys are contiguous).
  float vl = rl[kSlots - 1], vu = ru[kSlots - 1];
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const float ul = __shfl_up_sync(kAll, vl, d), uu = __shfl_up_sync(kAll, vu, d);
    const int uk = __shfl_up_sync(kAll, key[kSlots - 1], d);
    if (lane >= d && uk == key[kSlots - 1]) {
      vl += ul;
      vu += uu;
    }
  }
  const float prev_l = __shfl_up_sync(kAll, vl, 1), prev_u = __shfl_up_sync(kAll, vu, 1);
  const int prev_key = __shfl_up_sync(kAll, key[kSlots - 1], 1), next_key = __shfl_down_sync(kAll, key[0], 1);
#pragma unroll
  for (int e = 0; e + 1 < kSlots; ++e)
    if (key[e] != key[e + 1] && key[e] != kNone) {  // source e ends its run, which may have begun in earlier lanes
      const bool carry = from_first[e] && lane > 0 && prev_key == key[e];
      lower[key[e]] = carry ? prev_l + rl[e] : rl[e];
      upper[key[e]] = carry ? prev_u + ru[e] : ru[e];
    }
  if (key[kSlots - 1] != kNone && (lane == 31 || next_key != key[kSlots - 1])) {  // the last source ends its run
    lower[key[kSlots - 1]] = vl;
    upper[key[kSlots - 1]] = vu;
  }
}

}  // namespace
}  // namespace cuda
}  // namespace dqn_ops
