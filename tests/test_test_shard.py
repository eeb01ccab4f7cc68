"""DQN_OPS_TEST_SHARD (conftest.py): the GPU machine runs the suite in parts."""
import pytest

from conftest import _test_shard


@pytest.mark.parametrize("spec, want", [("", None), ("0/2", (0, 2)), ("1/2", (1, 2)), ("2/5", (2, 5))])
def test_shard_spec_parses(monkeypatch, spec, want):
    monkeypatch.setenv("DQN_OPS_TEST_SHARD", spec)
    assert _test_shard() == want


@pytest.mark.parametrize("spec", ["2/2", "-1/2", "0/0", "1", "a/b", "1/2/3"])
def test_a_bad_shard_spec_is_a_usage_error(monkeypatch, spec):
    monkeypatch.setenv("DQN_OPS_TEST_SHARD", spec)
    with pytest.raises(pytest.UsageError, match="DQN_OPS_TEST_SHARD must be"):
        _test_shard()
