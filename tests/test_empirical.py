"""Empirical-Bayes hyperparameters of PFNM / NAFI (ALGORITHMS.md §3, "Empirical Bayes"):
the truth found on generated clients, estimates that converge, given values kept fixed."""

import numpy as np
import pytest
from bench_truth import AUTHORS, POOL, pool_clients, recovered_share

import fusekit
from fusekit.methods.bayesian import empirical, get_backend, match_neurons

NUMPY = get_backend("numpy")


@pytest.fixture(scope="module")
def authors_setting():
    """The PFNM authors' synthetic setting at S = 10: 784-100-10 clients drawing 100 of
    150 true neurons."""
    return pool_clients(10, seed=0)


def test_the_default_infers_the_true_width_and_recovers_the_true_neurons(authors_setting):
    clients, truth = authors_setting
    inferred = fusekit.fuse(clients, method="pfnm", width="unlimited")
    assert abs(inferred.widths[0] - POOL) <= 0.1 * POOL
    hyper = inferred.report["layers"][0]["hyperparameters"]
    assert hyper["estimated"] == ["sigma", "sigma0", "gamma"] and hyper["em_converged"]
    # The generator's noise, 0.02^2 / (0.1^2 + 0.02^2) of the incoming weights' variance.
    assert hyper["sigma2_relative"] == pytest.approx(0.02**2 / (0.1**2 + 0.02**2), rel=0.1)
    fused = fusekit.fuse(clients, method="pfnm")
    assert fused.widths == [150]
    assert recovered_share(fused.state_dict, truth) >= 0.95
    # The authors' fixed values on the same clients: the reference the default beats.
    assert recovered_share(fusekit.fuse(clients, method="pfnm", **AUTHORS).state_dict,
                           truth) < 0.95


def test_estimating_costs_no_second_matching(authors_setting):
    """The values are estimated between the passes of the one matching: the default solves
    at most 1.5x the assignments of a run with the same values given."""
    clients, _ = authors_setting
    default = fusekit.fuse(clients, method="pfnm", width="unlimited")
    layer = default.report["layers"][0]
    hyper = layer["hyperparameters"]
    given = fusekit.fuse(clients, method="pfnm", width="unlimited",
                         sigma=hyper["sigma2_relative"], sigma0=hyper["sigma0_2_relative"],
                         gamma=hyper["gamma0"])
    assert layer["n_assignments"] <= 1.5 * given.report["layers"][0]["n_assignments"]


def ibp_clients(n_clients, gamma, dim, sigma, sigma0, seed):
    """Clients drawn from the model itself: an Indian buffet process of mass gamma over
    global neurons theta ~ N(0, sigma0^2 I), local neurons theta + N(0, sigma^2 I)."""
    rng = np.random.default_rng(seed)
    atoms, counts, vectors = [], [], []
    for s in range(1, n_clients + 1):
        ids = [i for i, m in enumerate(counts) if rng.random() < m / s]
        for _ in range(rng.poisson(gamma / s)):
            atoms.append(rng.normal(0, sigma0, dim))
            counts.append(0)
            ids.append(len(atoms) - 1)
        for i in ids:
            counts[i] += 1
        vectors.append(np.array([atoms[i] for i in ids]) + rng.normal(0, sigma, (len(ids), dim)))
    return vectors, len(atoms)


@pytest.mark.parametrize("seed", [0, 2])
def test_the_estimates_converge_to_the_generating_values(seed):
    vectors, n_atoms = ibp_clients(8, gamma=20.0, dim=30, sigma=0.1, sigma0=1.0, seed=seed)
    dim = vectors[0].shape[1]
    result, refit = empirical.estimate_and_match(vectors, [np.ones(dim, bool)] * 8,
                                                 np.ones(dim), backend=NUMPY)
    found = refit.result()
    # Stated tolerances: sigma^2 within 10 %, sigma0^2 within 15 %; gamma0 is the maximum-
    # likelihood value for the number of global neurons the clients hold (J / H_S with the
    # true J: every pool neuron recovered), itself within 25 % of the generating 20.
    assert found.sigma2 == pytest.approx(0.1**2, rel=0.10)
    assert found.sigma0_2 == pytest.approx(1.0, rel=0.15)
    assert found.gamma0 * empirical.harmonic(8) == pytest.approx(n_atoms)
    assert found.gamma0 == pytest.approx(20.0, rel=0.25)
    assert found.estimated == ("sigma", "sigma0", "gamma") and found.rounds >= 2
    # Converged: a last M-step moved no value by 1 %, and the result is the matching
    # those values give (a sweep moved no neuron).
    assert found.converged and result.width == n_atoms
    assert result.report["moves"][-1] == 0


def test_given_values_are_kept_and_matched_with_the_papers_cost():
    vectors, _ = ibp_clients(5, gamma=8.0, dim=12, sigma=0.2, sigma0=1.0, seed=1)
    dim = vectors[0].shape[1]
    observed = [np.ones(dim, bool)] * 5
    result, refit = empirical.estimate_and_match(vectors, observed, np.full(dim, 2.0),
                                                 sigma2=0.3, sigma0_2=0.8, gamma0=2.0,
                                                 backend=NUMPY)
    assert refit.result().estimated == () and refit.rounds == 0
    papers = match_neurons(vectors, [np.full(dim, 1 / 0.6)] * 5, sigma0_2=1.6, gamma0=2.0,
                           backend=NUMPY)
    np.testing.assert_array_equal(result.means, papers.means)
    for mine, theirs in zip(result.assignments, papers.assignments, strict=True):
        np.testing.assert_array_equal(mine, theirs)
    # A given sigma stays as given while sigma0 and gamma are estimated.
    _, partial = empirical.estimate_and_match(vectors, observed, np.ones(dim), sigma2=0.05,
                                              backend=NUMPY)
    found = partial.result()
    assert found.sigma2 == 0.05 and found.estimated == ("sigma0", "gamma")
    assert found.rounds >= 1 and found.sigma0_2 != empirical.START[1]


def test_estimated_values_give_the_members_means():
    """With estimated values the fused neuron is its members' mean (no pull towards mu0);
    with given values, the posterior mean (Eq. 4)."""
    vectors, _ = ibp_clients(4, gamma=6.0, dim=10, sigma=0.05, sigma0=1.0, seed=3)
    dim = vectors[0].shape[1]
    result, _ = empirical.estimate_and_match(vectors, [np.ones(dim, bool)] * 4, np.ones(dim),
                                             mu0=0.5, backend=NUMPY)
    stacked = np.vstack(vectors)
    rows = np.concatenate(result.assignments)
    for i in range(result.width):
        np.testing.assert_allclose(result.means[i], stacked[rows == i].mean(0), atol=1e-12)
    fixed = match_neurons(vectors, [1.0] * 4, mu0=0.5, sigma0_2=1.0, backend=NUMPY)
    rows = np.concatenate(fixed.assignments)
    counts = np.bincount(rows)
    expected = (0.5 + stacked[rows == 0].sum(0)) / (1 + counts[0])
    np.testing.assert_allclose(fixed.means[0], expected, atol=1e-12)


def test_nafi_estimates_with_the_models_cost_then_refines_with_its_own(authors_setting):
    """NAFI's KL penalty is no part of the model: its values are PFNM's estimates, and its
    own cost refines the matching afterwards (more sweeps)."""
    clients, _ = authors_setting
    pfnm = fusekit.fuse(clients, method="pfnm", width="unlimited").report["layers"][0]
    nafi = fusekit.fuse(clients, method="nafi", width="unlimited").report["layers"][0]
    for key in ("sigma2_relative", "sigma0_2_relative", "gamma0"):
        assert nafi["hyperparameters"][key] == pfnm["hyperparameters"][key]
    assert nafi["sweeps_run"] > pfnm["sweeps_run"]


def test_sigma2_is_pooled_over_all_but_the_loosest_quarter_of_the_globals():
    # Eight globals of 10 degrees of freedom each: six at variance 1, two at 9 (merges no
    # common noise level explains). Pooled over all, 3.0; the upper quartile of the
    # globals' own variances is 3.0, so the two loose ones are left out.
    dof = np.full(8, 10.0)
    scatter = dof * np.array([1, 1, 1, 1, 1, 1, 9, 9.0])
    assert scatter.sum() / dof.sum() == pytest.approx(3.0)
    assert empirical.trimmed_within(scatter, dof) == pytest.approx(1.0)
    # Equal variances (the model's case) are all kept; no shared global gives None.
    assert empirical.trimmed_within(np.array([4.0, 8.0]), np.array([2.0, 4.0])) == 2.0
    assert empirical.trimmed_within(np.zeros(3), np.zeros(3)) is None


def _numpy_log_det_rows(client_precision, global_precisions):
    seen = client_precision > 0
    return np.log(1.0 / client_precision[seen] + 1.0 / global_precisions[:, seen]).sum(axis=1)


def _numpy_add_moments(sums, squares, counts, rows, values, scale, seen):
    scaled = values * scale
    sums[rows] += scaled * seen
    squares[rows] += scaled * scaled * seen
    counts[rows] += seen


def _random_clients(n_clients, widths=(24, 32, 10)):
    """Independent random initialisations: nothing matches, the width is imposed."""
    clients = []
    for s in range(n_clients):
        rng = np.random.default_rng(100 + s)
        clients.append(fusekit.Checkpoint.from_state_dict({
            "fc1.weight": rng.normal(0, 0.2, (widths[1], widths[0])),
            "fc1.bias": np.zeros(widths[1]),
            "fc2.weight": rng.normal(0, 0.2, (widths[2], widths[1])),
            "fc2.bias": np.zeros(widths[2])}, {"fusekit.num_samples": str(50 + s)}))
    return clients


@pytest.mark.parametrize("method", ["pfnm", "nafi"])
def test_the_cores_estimation_kernels_fuse_what_their_numpy_forms_fuse(
        authors_setting, monkeypatch, method):
    """The M-step's moments and the log-determinant rows run in the C++ core; the fused
    models are those of the numpy forms, bit for bit (a speed change only)."""
    clients, _ = authors_setting
    cases = [(clients, {}), (clients, {"width": 120}), (_random_clients(5), {})]
    fast = [fusekit.fuse(c, method=method, **kw).state_dict for c, kw in cases]
    monkeypatch.setattr(empirical.matching, "add_moments", _numpy_add_moments)
    monkeypatch.setattr(empirical.matching, "log_det_rows", _numpy_log_det_rows)
    for got, (c, kw) in zip(fast, cases, strict=True):
        want = fusekit.fuse(c, method=method, **kw).state_dict
        assert got.keys() == want.keys()
        for name in want:
            assert np.array_equal(got[name], want[name]), name


def test_a_width_the_fixed_point_already_meets_costs_no_capped_sweep():
    """At a fixed point with nothing to prune, the capped re-match would give every client
    the assignment it has: the layer is the unlimited run's, with no sweep added; with
    globals pruned, the capped sweeps run."""
    vectors, n_atoms = ibp_clients(8, gamma=20.0, dim=30, sigma=0.1, sigma0=1.0, seed=0)
    dim = vectors[0].shape[1]
    observed = [np.ones(dim, bool)] * 8

    def run(width):
        return empirical.estimate_and_match(vectors, observed, np.ones(dim), width=width)[0]

    unlimited, met, pruned = run(None), run(n_atoms), run(n_atoms - 3)
    assert unlimited.report["moves"][-1] == 0 and met.report["pruned"] == 0
    assert met.report["sweeps_run"] == unlimited.report["sweeps_run"]
    for got, want in zip(met.assignments, unlimited.assignments, strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(met.means, unlimited.means)
    assert pruned.report["pruned"] == 3
    assert pruned.report["sweeps_run"] > unlimited.report["sweeps_run"]


def _dense_moments(vectors, observed, unit, assignments, n_global, mu0):
    """The moments from every (global, coordinate) pair's members, one pair at a time."""
    scale = 1.0 / np.sqrt(unit)
    members = [[[] for _ in range(unit.size)] for _ in range(n_global)]
    for vec, obs, rows in zip(vectors, observed, assignments, strict=True):
        for j, g in enumerate(rows):
            for p in np.flatnonzero(obs):
                members[g][p].append(vec[j, p] * scale[p])
    scatter, dof, between, inverse_n, seen = np.zeros(n_global), np.zeros(n_global), 0.0, 0.0, 0
    for g in range(n_global):
        for p in range(unit.size):
            values = np.array(members[g][p])
            if values.size:
                scatter[g] += np.sum((values - values.mean()) ** 2)
                dof[g] += values.size - 1
                between += (values.mean() - mu0 * scale[p]) ** 2
                inverse_n += 1.0 / values.size
                seen += 1
    return empirical.trimmed_within(scatter, dof), between / seen, inverse_n / seen


def test_moments_count_lone_globals_in_the_between_moments_only(monkeypatch):
    # Globals of one member (most of them when nothing matches across clients) have no
    # within-global scatter; the moments skip building their rows and must still agree.
    rng = np.random.default_rng(3)
    n_global, n_coords = 30, 12
    assignments = [rng.permutation(n_global)[:size] for size in (20, 9, 14)]
    vectors = [rng.normal(0.2, 1.0, (rows.size, n_coords)) for rows in assignments]
    observed = [rng.random(n_coords) > 0.3 for _ in assignments]
    unit = rng.uniform(0.5, 2.0, n_coords)
    got = empirical.moments(vectors, observed, unit, assignments, n_global, 0.1)
    want = _dense_moments(vectors, observed, unit, assignments, n_global, 0.1)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    # Shared globals taken a few at a time (as many thousands of wide ones are): the same.
    monkeypatch.setattr(empirical, "MOMENT_BLOCK_VALUES", 3 * n_coords + 1)
    np.testing.assert_allclose(empirical.moments(vectors, observed, unit, assignments,
                                                 n_global, 0.1), want, rtol=1e-12)
    lone = [np.arange(5), np.arange(5, 9)]
    assert empirical.moments([v[: r.size] for v, r in zip(vectors, lone)], observed[:2], unit,
                             lone, 9, 0.1)[0] is None
