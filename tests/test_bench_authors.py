"""The small-end benchmark's peer: the authors' PFNM code runs on the files fusekit fuses.

Their code is not redistributed with fusekit: the run is checked where a checkout of theirs
is named by $FUSEKIT_AUTHORS_PFNM (their matching/pfnm.py), as the benchmark takes it."""

import os

import pytest
from bench_authors import authors_code, authors_inputs, run_authors
from bench_scale import pool_inputs

import fusekit


def test_the_files_are_read_into_the_authors_layout(tmp_path):
    weights, frequencies = authors_inputs(pool_inputs(tmp_path, 3))
    assert [w.shape for w in weights[0]] == [(784, 100), (100,), (100, 10), (10,)]
    assert [f.shape for f in frequencies] == [(10,)] * 3


def test_a_missing_checkout_is_named_with_where_to_get_it(tmp_path):
    with pytest.raises(SystemExit, match="nope.py: the authors' matching/pfnm.py is not there"):
        authors_code(tmp_path / "nope.py")


@pytest.mark.skipif("FUSEKIT_AUTHORS_PFNM" not in os.environ,
                    reason="the authors' PFNM code is not redistributed: set "
                           "FUSEKIT_AUTHORS_PFNM to matching/pfnm.py of a checkout of theirs")
def test_the_authors_code_fuses_the_same_files_into_a_model_of_their_layout(tmp_path):
    paths = pool_inputs(tmp_path, 3)
    weights, frequencies = authors_inputs(paths)
    w1, b1, w2, b2 = run_authors(authors_code(os.environ["FUSEKIT_AUTHORS_PFNM"]), weights,
                                 frequencies)
    hidden = w1.shape[1]
    assert 100 <= hidden <= 300 and b1.shape == (hidden,) and w2.shape == (hidden, 10)
    assert b2.shape == (10,)
    ours = fusekit.fuse(paths, method="pfnm").state_dict
    assert ours["fc1.weight"].shape[1] == w1.shape[0] and ours["fc2.weight"].shape[0] == 10
