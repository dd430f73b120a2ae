"""tests/conftest.py's setup_failed: a setup step that failed skips the test, except where CI=true."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("ci, outcome", [("true", pytest.fail.Exception), ("TRUE", pytest.fail.Exception),
                                         ("", pytest.skip.Exception), ("false", pytest.skip.Exception)])
def test_a_failed_setup_step_fails_under_ci_and_skips_elsewhere(setup_failed, monkeypatch, ci, outcome):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match="no network"):
        setup_failed("no network")
