"""The run-time switches' environment variables (csrc/switches.h): each is read at its switch's
first use; unset or empty is the default, a listed name its value, and any other value raises at
every use, naming the variable, the names it takes and the value. The dense kernel's and the side
streams' variables have their tests beside their switches (test_dense_layer.py,
test_side_stream.py), the tile's and the head columns' beside theirs."""

import pytest

from conftest import first_forward_error, requires_cuda, switch_at_first_use

SPECTRAL = "DQN_OPS_SPECTRAL_STRATEGY"


@pytest.mark.parametrize("value,want", [(None, "auto"), ("", "auto"), ("auto", "auto"), ("cooperative", "cooperative"),
                                        ("cluster", None)], ids=["unset", "empty", "auto", "cooperative", "cluster"])
def test_the_spectral_strategy_variable_sets_the_strategy_at_its_first_use(value, want):
    # The setter returns the setting it replaces: the variable's value on the first call.
    lines = switch_at_first_use(SPECTRAL, value, "_C", "lambda: _C._set_spectral_strategy('cooperative'), "
                                "lambda: _C._set_spectral_strategy('auto')")
    if want is None:
        assert lines == [f"RuntimeError: dqn_ops: {SPECTRAL}: expected auto or cooperative, got 'cluster'"] * 2
    else:
        assert lines == [repr(want), repr("cooperative")]


@requires_cuda
@pytest.mark.parametrize("value", ["off", "2"])
def test_a_bad_pdl_setting_is_refused_by_name_at_the_first_launch(value):
    err = first_forward_error("DQN_OPS_PDL", value)
    assert f"dqn_ops: DQN_OPS_PDL: expected 0 or 1, got '{value}'" in err, err[-2000:]
