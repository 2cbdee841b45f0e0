"""benchmarks/bench_calibration.py: its data sets, case set-up and sign test."""

from __future__ import annotations

import bench_calibration as bc
import numpy as np
import pytest


def test_mnist1d_is_generated_offline_and_standardised_on_its_training_split():
    pytest.importorskip("mnist1d", reason="mnist1d is in the [bench] extra")
    data = bc.case_data("mnist1d", 300, 200)
    assert data.x_train.shape == (300, 40) and data.x_test.shape == (200, 40)
    assert data.x_train.dtype == np.float32 and set(np.unique(data.y_test)) <= set(range(10))
    np.testing.assert_allclose(data.x_train.mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(data.x_train.std(0), 1, atol=1e-4)
    assert not np.allclose(data.x_test.mean(0), 0, atol=1e-5)  # the test split's own moments
    arch, shape, _, _ = bc.case_setup("mlp_bn", data)
    assert arch["in_features"] == 40 and shape == (40,) and arch["batchnorm"]
    with pytest.raises(SystemExit, match="only the MLP cases"):
        bc.case_setup("vgg11_bn", data)


def test_digits_cases_keep_their_shapes():
    data = bc.case_data("digits", 0, 0)
    assert bc.case_setup("mlp", data)[0]["in_features"] == 64
    images = bc.inputs(data.x_test[:2], (1, 32, 32))
    assert images.shape == (2, 1, 32, 32)
    np.testing.assert_array_equal(images[:, :, :4, :4],  # each pixel a 4x4 block
                                  np.broadcast_to(data.x_test[:2, :, :1, :1], (2, 1, 4, 4)))


def test_sign_test_is_mcnemars_exact_two_sided_p():
    assert bc._sign_test(0, 0) == 1.0
    assert bc._sign_test(3, 1) == pytest.approx(0.625)  # 2 * (1 + 4) / 16
    assert bc._sign_test(0, 10) == pytest.approx(2 / 1024)
    assert bc._sign_test(5, 5) == 1.0
