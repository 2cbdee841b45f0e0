"""PFNM: probabilistic federated neural matching (NAFI paper Eq. 5; ALGORITHMS.md §3)."""

from __future__ import annotations

from collections.abc import Sequence

from fusekit.core.checkpoint import Checkpoint
from fusekit.core.spec import PermutationSpec
from fusekit.methods.base import FusionMethod, FusionResult, register
from fusekit.methods.bayesian import BayesianParams, as_sigma, fuse_network


def run_bayesian(method: FusionMethod, checkpoints, specs, params: BayesianParams) -> FusionResult:
    """Fuse with :func:`fuse_network` and package the result (shared by pfnm and nafi)."""
    state_dict, fused_spec, report = fuse_network(checkpoints, specs, params, method.name)
    return method.result(state_dict, checkpoints, fused_spec, params.as_json(), report)


@register
class PFNM(FusionMethod):
    name = "pfnm"
    summary = "Bayesian nonparametric neuron matching (PFNM); infers the fused width"
    permutes_neurons = True
    per_client_params = ("sigma",)

    def fuse(
        self,
        checkpoints: Sequence[Checkpoint],
        specs: Sequence[PermutationSpec],
        *,
        sigma: float | Sequence[float] = 1.0,
        sigma0: float = 1.0,
        gamma: float = 1.0,
        mu0: float = 0.0,
        sweeps: int = 5,
        seed: int = 0,
        max_width: int | None = None,
        class_share: bool | None = None,
        unobserved: str = "mask",
        variance_units: str = "relative",
        backend: str = "core",
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
