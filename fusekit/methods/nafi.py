"""NAFI: PFNM's cost plus a KL penalty (NAFI paper Eq. 14, Lemma 5.1; ALGORITHMS.md §4)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

from fusekit.core.checkpoint import Checkpoint
from fusekit.core.spec import PermutationSpec
from fusekit.methods.base import FusionMethod, FusionResult, register
from fusekit.methods.bayesian import BayesianParams, as_sigma
from fusekit.methods.params import Param
from fusekit.methods.pfnm import (
    Backend,
    ClassShare,
    Gamma,
    MaxWidth,
    Mu0,
    Seed,
    Sigma,
    Sigma0,
    Sweeps,
    Unobserved,
    VarianceUnits,
    run_bayesian,
)

DEFAULT_LAMBDA = 1e-2


@register
class NAFI(FusionMethod):
    name = "nafi"
    summary = "PFNM with the KL penalty of NAFI (neural aggregation with full information)"
    permutes_neurons = True

    def fuse(
        self,
        checkpoints: Sequence[Checkpoint],
        specs: Sequence[PermutationSpec],
        *,
        lam: Annotated[float, Param(
            help="weight lambda of the KL penalty (0 gives PFNM's result; the paper reports "
            "stable results for 0.001 to 0.5)", paper="NAFI Eq. 14, Lemma 5.1", minimum=0,
            flags=("--lambda",))] = DEFAULT_LAMBDA,
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
