"""PFNM: probabilistic federated neural matching (NAFI paper Eq. 5; ALGORITHMS.md §3)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

from fusekit.core.checkpoint import Checkpoint
from fusekit.core.spec import PermutationSpec
from fusekit.methods.base import FusionMethod, FusionResult, register
from fusekit.methods.bayesian import (
    BACKENDS,
    UNOBSERVED,
    VARIANCE_UNITS,
    BayesianParams,
    as_sigma,
    fuse_network,
)
from fusekit.methods.params import Param

# The parameters PFNM and NAFI share, declared once.
Sigma = Annotated[float | Sequence[float], Param(
    help="client noise variance sigma^2 in variance units; one value or one per client "
    "(in the order of the inputs)", paper="PFNM Eq. 5 (sigma_s^2)", above=0)]
Sigma0 = Annotated[float, Param(
    help="prior variance sigma0^2 of the global neurons, in variance units",
    paper="PFNM Eq. 4 (sigma_0^2)", above=0)]
Gamma = Annotated[float, Param(
    help="Beta-process mass gamma0; larger opens new neurons more readily",
    paper="PFNM Eq. 5 (gamma_0)", above=0)]
Mu0 = Annotated[float, Param(help="prior mean of the global neurons (weight units)",
                             paper="PFNM Eq. 4 (mu_0)")]
Sweeps = Annotated[int, Param(help="refinement sweeps after the greedy pass",
                              paper="NAFI Algorithm 1 (T)", minimum=0, maximum=1000)]
Seed = Annotated[int, Param(help="seed of the client order of the sweeps (layer l uses seed + l)",
                            minimum=0)]
MaxWidth = Annotated[int | None, Param(
    help="cap on every fused hidden width (at least the widest client)", minimum=1)]
ClassShare = Annotated[bool | None, Param(
    help="class-share precision of outgoing weights and class-share averaging of the "
    "output layer", paper="NAFI Algorithm 2", default_text="on when every client has class counts")]
Unobserved = Annotated[str, Param(
    help="mask: coordinates a client lacks are unobserved; zeros: observed zeros at full "
    "precision, as the authors' code", choices=UNOBSERVED)]
VarianceUnits = Annotated[str, Param(
    help="relative: sigma, sigma0 in multiples of the layer's per-coordinate weight variance; "
    "absolute: as given", choices=VARIANCE_UNITS)]
Backend = Annotated[str, Param(
    help="core: fusekit's C++ kernels; numpy: reference kernels and SciPy", choices=BACKENDS)]


def run_bayesian(method: FusionMethod, checkpoints, specs, params: BayesianParams) -> FusionResult:
    """Fuse with :func:`fuse_network` and package the result (shared by pfnm and nafi)."""
    state_dict, fused_spec, report = fuse_network(checkpoints, specs, params, method.name)
    return method.result(state_dict, checkpoints, fused_spec, params.as_json(), report)


@register
class PFNM(FusionMethod):
    name = "pfnm"
    summary = "Bayesian nonparametric neuron matching (PFNM); infers the fused width"
    permutes_neurons = True

    def fuse(
        self,
        checkpoints: Sequence[Checkpoint],
        specs: Sequence[PermutationSpec],
        *,
        sigma: Sigma = 1.0,
        sigma0: Sigma0 = 1.0,
        gamma: Gamma = 1.0,
        mu0: Mu0 = 0.0,
        sweeps: Sweeps = 5,
        seed: Seed = 0,
        max_width: MaxWidth = None,
        class_share: ClassShare = None,
        unobserved: Unobserved = "mask",
        variance_units: VarianceUnits = "relative",
        backend: Backend = "core",
    ) -> FusionResult:
        """Match hidden neurons bottom-up with PFNM's cost and average matched neurons.

        Args:
            sigma: client noise variance sigma_s^2: one value, or one per client (given to
                ``fusekit.fuse`` in the order of its inputs; this method receives them in
                the canonical client order, as ``report["clients"]`` lists it); in units
                of the layer's weight variance (see variance_units).
            sigma0: prior variance sigma0^2 of global neurons, same units.
            gamma: Beta-process mass gamma0 (> 0); larger opens new neurons more readily.
            mu0: prior mean of the global neurons (weight units).
            sweeps: refinement sweeps after the greedy pass (T).
            seed: seeds the client order of the sweeps (layer l uses seed + l).
            max_width: optional cap on every fused hidden width (>= the widest client).
            class_share: outgoing weights get precision f_sk/sigma^2 and the output layer
                class-share weights; default: on when every client has class counts.
            unobserved: "mask" (coordinates a client lacks have precision 0, ALGORITHMS §2)
                or "zeros" (observed zeros at full precision, as the authors' code does).
            variance_units: "relative" (multiples of the per-coordinate weight variance of
                the layer's neuron vectors, per block) or "absolute".
            backend: "core" (C++ kernels) or "numpy" (reference kernels + SciPy).

        Raises:
            IncompatibleModelsError: PAN checkpoints (use avg).
            ParameterError: out-of-range parameters.
        """
        params = BayesianParams(
            sigma=as_sigma(sigma), sigma0=sigma0, gamma=gamma, mu0=mu0, sweeps=sweeps,
            seed=seed, max_width=max_width, class_share=class_share, unobserved=unobserved,
            variance_units=variance_units, backend=backend,
        )
        return run_bayesian(self, checkpoints, specs, params)
