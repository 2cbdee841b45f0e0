"""The C++ cost kernels against the numpy references in fusekit.engine.reference."""

from __future__ import annotations

import numpy as np
import pytest

from fusekit.core.errors import ParameterError
from fusekit.engine import matching, reference


def assert_close(actual, expected):
    assert actual.shape == expected.shape
    assert actual.dtype == np.float64
    np.testing.assert_allclose(
        actual, expected, rtol=1e-10, atol=1e-12 * (1 + np.abs(expected).max(initial=0))
    )


def posterior_state(rng, j_global, j_local, p, *, per_coordinate, unobserved, n_clients=8):
    """A random but valid global posterior and client, as PFNM/NAFI build them."""
    sigma0_2 = rng.uniform(0.5, 2.0, p) if per_coordinate else 1.3
    mu0 = rng.normal(scale=0.1, size=p) if per_coordinate else 0.05
    client_precision = rng.uniform(0.5, 20.0, p) if per_coordinate else 4.0
    if unobserved:
        client_precision = np.broadcast_to(client_precision, (p,)).copy()
        client_precision[rng.random(p) < 0.3] = 0.0
    prior_precision = 1.0 / np.broadcast_to(sigma0_2, (p,))
    precisions = prior_precision + rng.uniform(0.0, 30.0, (j_global, p))
    means = rng.normal(size=(j_global, p))
    sums = means * precisions
    counts = rng.integers(1, n_clients, j_global)
    local = rng.normal(size=(j_local, p))
    if j_global and j_local:
        local[0] = means[0]  # an exact match: no cancellation allowed
    args = (local, client_precision, sums, precisions, counts)
    kwargs = dict(n_clients=n_clients, mu0=mu0, sigma0_2=sigma0_2, gamma0=rng.uniform(0.5, 3.0))
    return args, kwargs


SHAPES = [(0, 1, 3), (1, 1, 1), (5, 3, 7), (17, 9, 130), (40, 25, 300), (3, 30, 1), (9, 5, 0)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("per_coordinate", [False, True])
@pytest.mark.parametrize("unobserved", [False, True])
def test_pfnm_and_nafi_match_reference(shape, per_coordinate, unobserved):
    rng = np.random.default_rng(hash((shape, per_coordinate, unobserved)) % 2**32)
    args, kwargs = posterior_state(
        rng, *shape, per_coordinate=per_coordinate, unobserved=unobserved
    )
    assert_close(matching.pfnm_cost(*args, **kwargs), reference.pfnm_cost(*args, **kwargs))
    for lam in [0.0, 1e-2, 0.7]:
        assert_close(
            matching.nafi_cost(*args, **kwargs, lam=lam),
            reference.nafi_cost(*args, **kwargs, lam=lam),
        )


def test_many_random_posteriors_match_reference():
    rng = np.random.default_rng(2024)
    for trial in range(150):
        shape = tuple(int(x) for x in rng.integers(1, 12, size=3))
        args, kwargs = posterior_state(
            rng, *shape, per_coordinate=bool(trial % 2), unobserved=trial % 3 == 0
        )
        lam = float(rng.choice([0.0, 1e-3, 0.5]))
        assert_close(
            matching.nafi_cost(*args, **kwargs, lam=lam),
            reference.nafi_cost(*args, **kwargs, lam=lam),
        )


@pytest.mark.parametrize("direct", [True, False])
def test_products_above_the_single_precision_threshold_keep_the_costs(direct):
    """From _core.SINGLE_PRECISION_FLOPS the product is in single precision: the costs stay
    within its rounding of the double-precision ones (a corner of the matrix, computed
    alone below the threshold), an exact match is still costed exactly, and the local
    neurons placed near globals are assigned to them."""
    from fusekit._core import SINGLE_PRECISION_FLOPS

    rng = np.random.default_rng(7)
    j_global, j_local, p = 1100, 500, 1000
    assert 2 * j_global * j_local * p >= SINGLE_PRECISION_FLOPS
    args, kwargs = posterior_state(rng, j_global, j_local, p, per_coordinate=not direct,
                                   unobserved=not direct)
    local, _, sums, precisions, _ = args
    if direct:  # one precision per global: the product of the sums and vectors themselves
        means = sums / precisions
        precisions[:] = precisions[:, :1]
        sums[:] = means * precisions
        local[0] = means[0]
    local[1:100] = sums[1:100] / precisions[1:100] + rng.normal(0, 0.05, (99, p))  # matches
    corner = (local[:50], args[1], sums[:200], precisions[:200], args[4][:200])
    assert 2 * 200 * 50 * p < SINGLE_PRECISION_FLOPS
    for lam in (0.0, 0.7):
        cost = matching.nafi_cost(*args, **kwargs, lam=lam)
        expected = matching.nafi_cost(*corner, **kwargs, lam=lam)[:200]
        np.testing.assert_allclose(cost[:200, :50], expected, rtol=1e-5)
        np.testing.assert_allclose(cost[0, 0], expected[0, 0], rtol=1e-12)
        rows, cols = matching.solve_assignment(cost)
        assert (rows[np.argsort(cols)][:100] == np.arange(100)).all()


def test_pfnm_cost_formula_by_hand():
    # One global neuron, one local neuron, P = 1: every term of ALGORITHMS.md §3 explicit.
    s, prec, mean, w, sigma0_2, mu0, n_i, n_clients, gamma0 = (
        4.0,
        3.0,
        0.5,
        1.5,
        2.0,
        0.1,
        2,
        5,
        1.5,
    )
    cost = matching.pfnm_cost(
        [[w]],
        s,
        [[mean * prec]],
        [[prec]],
        [n_i],
        n_clients=n_clients,
        mu0=mu0,
        sigma0_2=sigma0_2,
        gamma0=gamma0,
    )
    existing = (w - mean) ** 2 / (1 / s + 1 / prec) + 2 * np.log((n_clients - n_i) / n_i)
    new = (w - mu0) ** 2 / (1 / s + sigma0_2) + 2 * np.log(n_clients / gamma0)
    np.testing.assert_allclose(cost, [[existing], [new]], rtol=1e-14)


def test_unobserved_coordinates_cost_nothing():
    rng = np.random.default_rng(1)
    args, kwargs = posterior_state(rng, 6, 4, 10, per_coordinate=True, unobserved=False)
    local, precision, *rest = args
    precision = precision.copy()
    precision[3:] = 0.0
    moved = local.copy()
    moved[:, 3:] += 100.0
    np.testing.assert_allclose(
        matching.nafi_cost(moved, precision, *rest, **kwargs),
        matching.nafi_cost(local, precision, *rest, **kwargs),
        rtol=1e-12,
    )


@pytest.mark.parametrize("unobserved", [False, True])
def test_blocks_of_equal_precision_match_reference(unobserved):
    # PFNM's state on a network: one precision per client and tensor, so the coordinates
    # come in blocks over which every global has one precision (its members' count times the
    # block's). The kernel weighs each block once; a block's last coordinate differing in
    # one global only must split it. Every entry as the reference computes it.
    rng = np.random.default_rng(7)
    lengths = [40, 1, 9, 30, 2, 25]
    block_precision = np.repeat(rng.uniform(0.5, 20.0, len(lengths)), lengths)
    prior = np.repeat(rng.uniform(0.5, 2.0, len(lengths)), lengths)
    p, j_global, j_local = block_precision.size, 33, 12
    members = rng.integers(1, 5, (j_global, 1))
    precisions = 1.0 / prior + members * block_precision
    precisions[5, lengths[0] - 1] += 0.5
    client_precision = block_precision.copy()
    if unobserved:
        client_precision[rng.random(p) < 0.2] = 0.0
    means = rng.normal(size=(j_global, p))
    local = rng.normal(size=(j_local, p))
    local[0] = means[3]
    args = (local, client_precision, means * precisions, precisions, members[:, 0])
    kwargs = dict(n_clients=6, mu0=0.0, sigma0_2=prior, gamma0=1.3)
    assert_close(matching.pfnm_cost(*args, **kwargs), reference.pfnm_cost(*args, **kwargs))
    assert_close(matching.nafi_cost(*args, **kwargs, lam=0.3),
                 reference.nafi_cost(*args, **kwargs, lam=0.3))


def test_new_neuron_block_penalties_increase():
    rng = np.random.default_rng(4)
    args, kwargs = posterior_state(rng, 3, 5, 4, per_coordinate=False, unobserved=False)
    cost = matching.pfnm_cost(*args, **kwargs)
    new = cost[3:]
    np.testing.assert_allclose(
        np.diff(new, axis=0), 2 * np.diff(np.log(np.arange(1, 6)))[:, None] * np.ones((1, 5))
    )


@pytest.mark.parametrize(
    "shape", [(0, 0, 3), (0, 4, 2), (5, 0, 2), (3, 4, 0), (7, 11, 5), (70, 90, 257)]
)
def test_sqeuclidean_matches_reference(shape):
    n, m, p = shape
    rng = np.random.default_rng(n * 10_000 + m * 100 + p)
    a, b = rng.normal(size=(n, p)), rng.normal(size=(m, p))
    assert_close(matching.sqeuclidean_cost(a, b), reference.sqeuclidean_cost(a, b))


def test_sqeuclidean_is_exact_for_identical_rows_and_accepts_views():
    rng = np.random.default_rng(8)
    a = rng.normal(size=(20, 40)) * 1e6
    cost = matching.sqeuclidean_cost(a, a)
    assert (np.diag(cost) == 0).all() and (cost >= 0).all()
    base = rng.normal(size=(30, 50))
    a, b = base[::2, ::3], np.asfortranarray(base[1::4, ::3])
    assert_close(matching.sqeuclidean_cost(a, b), reference.sqeuclidean_cost(a, b))


def test_sqeuclidean_rejects_bad_input():
    with pytest.raises(ValueError, match="same number of columns"):
        matching.sqeuclidean_cost(np.ones((2, 3)), np.ones((2, 4)))
    with pytest.raises(ValueError, match="2-D"):
        matching.sqeuclidean_cost(np.ones(3), np.ones((2, 3)))
    with pytest.raises(ValueError, match="finite"):
        matching.sqeuclidean_cost(np.array([[np.nan]]), np.ones((1, 1)))


def valid_args():
    rng = np.random.default_rng(0)
    return posterior_state(rng, 4, 3, 5, per_coordinate=True, unobserved=False)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a, k: a.__setitem__(4, np.array([0, 1, 2, 8])), "global_counts"),
        (lambda a, k: a.__setitem__(3, -a[3]), "global_precisions"),
        (lambda a, k: a.__setitem__(1, -np.ones(5)), "client_precision"),
        (lambda a, k: a.__setitem__(1, np.ones(4)), "client_precision"),
        (lambda a, k: a.__setitem__(2, a[2][:, :4]), "global_sums"),
        (lambda a, k: a.__setitem__(0, np.full((3, 5), np.nan)), "local"),
        (lambda a, k: k.__setitem__("sigma0_2", 0.0), "sigma0_2"),
        (lambda a, k: k.__setitem__("gamma0", -1.0), "gamma0"),
        (lambda a, k: k.__setitem__("n_clients", 1), "n_clients"),
        (lambda a, k: k.__setitem__("lam", -0.1), "lam"),
    ],
)
def test_posterior_cost_rejects_bad_arguments(change, message):
    args, kwargs = valid_args()
    args = list(args)
    kwargs = dict(kwargs, lam=0.1)
    change(args, kwargs)
    with pytest.raises(ValueError, match=message):
        matching.nafi_cost(*args, **kwargs)


def test_parameter_errors_are_fusekit_errors():
    args, kwargs = valid_args()
    with pytest.raises(ParameterError):
        matching.pfnm_cost(*args, **dict(kwargs, gamma0=0.0))
