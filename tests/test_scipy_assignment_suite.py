"""SciPy's own tests of ``linear_sum_assignment``, run against ``solve_assignment``.

The tests are SciPy's (scipy/optimize/tests/test_linear_assignment.py, BSD licence, by
Brian M. Clapper, G. Varoquaux and Lars Buitinck), imported from the installed SciPy, so
they follow its version; each runs with the module's ``linear_sum_assignment`` replaced by
fusekit's solver, which claims to be a drop-in for it.
"""

import functools

import pytest
import scipy.optimize.tests.test_linear_assignment as scipy_suite

from fusekit.engine.matching import solve_assignment


def _collectable(test):
    """``test`` with its parametrize marks' values as lists: SciPy passes an iterator
    (``itertools.product``), which pytest deprecates and which only one collection
    could consume."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        return test(*args, **kwargs)

    run.pytestmark = []
    for mark in getattr(test, "pytestmark", []):
        if mark.name == "parametrize":
            names, values, *rest = mark.args
            mark = pytest.mark.parametrize(names, list(values), *rest, **mark.kwargs).mark
        run.pytestmark.append(mark)
    return run


SCIPY_TESTS = {name: _collectable(test) for name, test in vars(scipy_suite).items()
               if name.startswith("test_") and callable(test)}
globals().update(SCIPY_TESTS)


@pytest.fixture(autouse=True)
def _fusekit_solver(monkeypatch):
    monkeypatch.setattr(scipy_suite, "linear_sum_assignment", solve_assignment)


def test_the_suite_is_there_and_runs_fusekit_solver():
    assert len(SCIPY_TESTS) >= 10  # SciPy 1.17 has 11 functions (22 cases)
    assert scipy_suite.linear_sum_assignment is solve_assignment
