"""NAFI: PFNM's cost plus a KL penalty (NAFI paper Eq. 14, Lemma 5.1; ALGORITHMS.md §4)."""

from __future__ import annotations

from collections.abc import Sequence

from fusekit.core.checkpoint import Checkpoint
from fusekit.core.spec import PermutationSpec
from fusekit.methods.base import FusionMethod, FusionResult, register
from fusekit.methods.bayesian import BayesianParams, as_sigma
from fusekit.methods.pfnm import run_bayesian

DEFAULT_LAMBDA = 1e-2


@register
class NAFI(FusionMethod):
    name = "nafi"
    summary = "PFNM with the KL penalty of NAFI (neural aggregation with full information)"
    permutes_neurons = True
    per_client_params = ("sigma",)

    def fuse(
        self,
        checkpoints: Sequence[Checkpoint],
        specs: Sequence[PermutationSpec],
        *,
        lam: float = DEFAULT_LAMBDA,
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
        """PFNM with cost C + lam * KL(posterior before || after adding the local neuron).

        Args:
            lam: weight lambda of the KL penalty (>= 0; 0 gives PFNM's result). The paper
                reports stable results for 1e-3 <= lambda <= 0.5.
            Other parameters: as :meth:`fusekit.methods.pfnm.PFNM.fuse`.

        Raises:
            IncompatibleModelsError: PAN checkpoints (use avg).
            ParameterError: out-of-range parameters.
        """
        params = BayesianParams(
            sigma=as_sigma(sigma), sigma0=sigma0, gamma=gamma, mu0=mu0, sweeps=sweeps,
            seed=seed, lam=float(lam), max_width=max_width, class_share=class_share,
            unobserved=unobserved, variance_units=variance_units, backend=backend,
        )
        return run_bayesian(self, checkpoints, specs, params)
