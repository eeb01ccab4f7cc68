"""scripts/profile_step.py's slicing of a trace of three back-to-back replays into the middle one."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from profile_step import middle_of_three  # noqa: E402


def test_the_middle_replay_with_its_starts_from_its_own_first():
    trace = [("cast", 0.0, 1.0), ("gemm", 2.0, 3.0), ("cast", 70.0, 1.0), ("gemm", 71.5, 2.5),
             ("cast", 140.0, 1.0), ("gemm", 142.0, 3.0)]
    assert middle_of_three(trace) == [("cast", 0.0, 1.0), ("gemm", 1.5, 2.5)]


def test_a_trace_that_is_not_three_equal_runs_gives_nothing():
    assert middle_of_three([]) == []
    assert middle_of_three([("a", 0.0, 1.0), ("b", 1.0, 1.0)]) == []  # fewer kernels than three runs
    assert middle_of_three([("a", 0.0, 1.0), ("b", 1.0, 1.0), ("a", 2.0, 1.0), ("a", 3.0, 1.0), ("b", 4.0, 1.0),
                            ("a", 5.0, 1.0)]) == []  # runs interleaved across replays
