"""The small-end benchmark's peer: the authors' PFNM code runs on the files fusekit fuses."""

from bench_authors import authors_inputs, run_authors
from bench_scale import pool_inputs

import fusekit


def test_the_authors_code_fuses_the_same_files_into_a_model_of_their_layout(tmp_path):
    paths = pool_inputs(tmp_path, 3)
    weights, frequencies = authors_inputs(paths)
    assert [w.shape for w in weights[0]] == [(784, 100), (100,), (100, 10), (10,)]
    assert [f.shape for f in frequencies] == [(10,)] * 3
    w1, b1, w2, b2 = run_authors(weights, frequencies)
    hidden = w1.shape[1]
    assert 100 <= hidden <= 300 and b1.shape == (hidden,) and w2.shape == (hidden, 10)
    assert b2.shape == (10,)
    ours = fusekit.fuse(paths, method="pfnm").state_dict
    assert ours["fc1.weight"].shape[1] == w1.shape[0] and ours["fc2.weight"].shape[0] == 10
