"""The Python Philox4x32-10 of tests/reference.py (the reference for every op's random draws)
against Random123's published known-answer vectors, and the C++ one (csrc/philox.h) against it."""
import os
import shutil
import subprocess

import pytest

from reference import STREAM_ACT, STREAM_ENV, STREAM_REPLAY, philox4x32_10, philox_below, philox_draw, philox_index_below, philox_uniform

# Random123 kat_vectors: counter (4 words), key (2 words) -> output (4 words).
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", KNOWN_ANSWERS)
def test_known_answers(counter, key, expected):
    assert philox4x32_10(counter, key) == expected


def test_uniform_and_below_ranges():
    assert philox_uniform(0) == 0.0 and philox_uniform(0xFFFFFFFF) < 1.0
    assert philox_below(0xFFFFFFFF, 3) == 2 and philox_below(0, 3) == 0
    assert all(0 <= philox_below(philox_draw(STREAM_ACT, 7, 0, r, 1), 5) < 5 for r in range(100))


def test_streams_draw_different_numbers_for_the_same_seed_call_row_and_slot():
    draws = {stream: [philox_draw(stream, 3, 0, row, slot) for row in range(20) for slot in range(4)]
             for stream in (STREAM_ACT, STREAM_REPLAY, STREAM_ENV)}
    assert len({tuple(d) for d in draws.values()}) == 3
    assert not set(draws[STREAM_ACT]) & set(draws[STREAM_ENV])


CXX_CHECK = r"""
#include <cstdio>
#include "philox.h"
int main() {
  using namespace dqn_ops::philox;
  const unsigned long long seeds[] = {0ull, 1ull, 0x123456789abcdefull, ~0ull};
  const unsigned long long calls[] = {0ull, 5ull, 0x100000003ull};
  for (unsigned long long s : seeds)
    for (unsigned long long c : calls)
      for (unsigned row = 0; row < 3; ++row)
        for (unsigned slot = 0; slot < 9; ++slot) {
          unsigned bits = draw(static_cast<Stream>(1 + (row + slot) % 3), s, c, row * 977u, slot);
          std::printf("%u %lld\n", bits, (long long)below(bits, 7));
        }
  Words w = philox4x32_10(Words{{0x243F6A88u, 0x85A308D3u, 0x13198A2Eu, 0x03707344u}}, 0xA4093822u, 0x299F31D0u);
  std::printf("%u %u %u %u\n", w.w[0], w.w[1], w.w[2], w.w[3]);
}
"""


needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to compile csrc/philox.h on its own")


def run_cxx(tmp_path, source: str) -> str:
    """Compiles `source` (a main() including philox.h) with g++ and returns what it prints."""
    src, exe = tmp_path / "check.cpp", tmp_path / "check"
    src.write_text(source)
    csrc = os.path.join(os.path.dirname(__file__), "..", "csrc")
    subprocess.run(["g++", "-std=c++17", "-O1", "-I", csrc, str(src), "-o", str(exe)], check=True)
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout


@needs_gxx
def test_cxx_matches_python(tmp_path):
    lines = run_cxx(tmp_path, CXX_CHECK).split("\n")
    expected = []
    for s in (0, 1, 0x123456789ABCDEF, 2**64 - 1):
        for c in (0, 5, 0x100000003):
            for row in range(3):
                for slot in range(9):
                    bits = philox_draw(1 + (row + slot) % 3, s, c, row * 977, slot)
                    expected.append(f"{bits} {philox_below(bits, 7)}")
    expected.append(" ".join(str(w) for w in KNOWN_ANSWERS[2][2]))
    assert lines[:len(expected)] == expected


def test_index_below_reaches_every_index_of_a_large_range():
    # below() goes through a 24-bit float: for n > 2^24 it skips indices; index_below must not.
    import random
    rng = random.Random(5)
    for n in (1, 3, 2**24 + 3, 10_000_019, 2**32 - 1):
        assert philox_index_below(0, n) == 0 and philox_index_below(2**32 - 1, n) == n - 1
        for k in [0, n - 1] + [rng.randrange(n) for _ in range(200)]:
            bits = -((-k << 32) // n)  # the smallest bits with bits * n >= k * 2^32
            assert philox_index_below(bits, n) == k
            if bits > 0:
                assert philox_index_below(bits - 1, n) == k - 1


CXX_INDEX_CHECK = r"""
#include <cstdio>
#include "philox.h"
int main() {
  using namespace dqn_ops::philox;
  const unsigned ns[] = {1u, 7u, 16777219u, 10000019u, 4294967295u};
  for (unsigned n : ns)
    for (unsigned row = 0; row < 50; ++row) {
      unsigned bits = draw(Stream::kReplay, 11, 3, row, row % 5);
      std::printf("%lld\n", (long long)index_below(bits, n));
    }
}
"""


@needs_gxx
def test_cxx_index_below_matches_python(tmp_path):
    got = run_cxx(tmp_path, CXX_INDEX_CHECK).split()
    expected = [str(philox_index_below(philox_draw(STREAM_REPLAY, 11, 3, row, row % 5), n))
                for n in (1, 7, 16777219, 10000019, 4294967295) for row in range(50)]
    assert got == expected
