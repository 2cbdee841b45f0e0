"""PFNM and NAFI: Bayesian nonparametric neuron matching (ALGORITHMS.md §3-4).

One method class, :class:`BayesianMatching`, registered twice: ``pfnm`` (lambda = 0, PFNM's
cost, NAFI paper Eq. 5) and ``nafi`` (lambda > 0, the KL-penalised cost of Eq. 14). Its
parts: :mod:`.layer` matches the neurons of one layer, :mod:`.empirical` estimates a
layer's hyperparameters, :mod:`.network` drives whole networks layer by layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, ClassVar

from fusekit.core.checkpoint import Checkpoint
from fusekit.core.spec import GraphSpec, PermutationSpec
from fusekit.core.transformer import TransformerSpec
from fusekit.methods.base import FusionMethod, FusionResult, places_cost_kernels, register
from fusekit.methods.bayesian.layer import (
    BACKENDS,
    LayerMatching,
    MatchingBackend,
    get_backend,
    match_neurons,
    matching_purity,
)
from fusekit.methods.bayesian.network import (
    CLASS_WEIGHTS,
    DEFAULT_WIDTH_RATIO,
    UNLIMITED,
    UNOBSERVED,
    VARIANCE_UNITS,
    BayesianParams,
    as_sigma,
    as_width,
    fuse_groups,
    fuse_network,
    ratio_width,
)
from fusekit.methods.bayesian.transformer import fuse_transformer_mlps
from fusekit.methods.params import Device, Param

#: NAFI's default KL weight (ALGORITHMS.md §4 explains its scale).
DEFAULT_LAMBDA = 0.01

__all__ = [
    "DEFAULT_LAMBDA",
    "DEFAULT_WIDTH_RATIO",
    "UNLIMITED",
    "BayesianMatching",
    "LayerMatching",
    "MatchingBackend",
    "get_backend",
    "match_neurons",
    "matching_purity",
    "ratio_width",
]


class BayesianMatching(FusionMethod):
    """Bayesian neuron matching; ``default_lam`` tells PFNM (0) from NAFI (> 0)."""

    permutes_neurons = True
    folds_batchnorm = True
    handles_groups = True
    handles_transformers = True
    default_lam: ClassVar[float] = 0.0

    @places_cost_kernels
    def fuse(
        self,
        checkpoints: Sequence[Checkpoint],
        specs: Sequence[PermutationSpec],
        *,
        width: Annotated[int | Sequence[int] | str | None, Param(
            help="fused width of every hidden layer, one width per hidden layer, or "
            "'unlimited' (the width the posterior infers)", choices=(UNLIMITED,), minimum=1,
            default_text="--width-ratio")] = None,
        width_ratio: Annotated[float | None, Param(
            help="fused width relative to the widest client, rounded half up; give width or "
            "width_ratio, not both", minimum=1,
            default_text=f"{DEFAULT_WIDTH_RATIO} when no width is given")] = None,
        lam: Annotated[float | None, Param(
            help="weight lambda of NAFI's KL penalty (0 is PFNM's cost)",
            paper="NAFI Eq. 14, Lemma 5.1", minimum=0, flags=("--lambda",),
            default_text=f"0 for pfnm, {DEFAULT_LAMBDA} for nafi")] = None,
        sigma: Annotated[float | Sequence[float] | None, Param(
            help="client noise variance sigma^2 in variance units; one value or one per client "
            "(in the order of the inputs)", paper="PFNM Eq. 5 (sigma_s^2)", above=0,
            default_text="estimated (empirical Bayes)")] = None,
        sigma0: Annotated[float | None, Param(
            help="prior variance sigma0^2 of the global neurons, in variance units",
            paper="PFNM Eq. 4 (sigma_0^2)", above=0,
            default_text="estimated (empirical Bayes)")] = None,
        gamma: Annotated[float | None, Param(
            help="Beta-process mass gamma0; larger opens new neurons more readily",
            paper="PFNM Eq. 5 (gamma_0)", above=0,
            default_text="estimated (empirical Bayes)")] = None,
        mu0: Annotated[float, Param(help="prior mean of the global neurons (weight units)",
                                    paper="PFNM Eq. 4 (mu_0)")] = 0.0,
        sweeps: Annotated[int, Param(
            help="refinement sweeps after the greedy pass and after the width is imposed",
            paper="NAFI Algorithm 1 (T)", minimum=0, maximum=1000)] = 5,
        seed: Annotated[int, Param(
            help="seed of the client order of the sweeps (layer l uses seed + l)",
            minimum=0)] = 0,
        class_share: Annotated[bool | None, Param(
            help="class-share precision of outgoing weights and class-share averaging of the "
            "output layer", paper="NAFI Algorithm 2",
            default_text="on when every client has class counts")] = None,
        class_weights: Annotated[str, Param(
            help="per-class client weights of class_share: information (N_sk (1 - N_sk/N_s): "
            "a client that saw only class k gets no weight for k) or counts (N_sk, the "
            "paper's class shares)", paper="NAFI Algorithm 2, line 7 (counts)",
            choices=CLASS_WEIGHTS)] = "information",
        unobserved: Annotated[str, Param(
            help="mask: coordinates a client lacks are unobserved; zeros: observed zeros at "
            "full precision, as the authors' code", choices=UNOBSERVED)] = "mask",
        variance_units: Annotated[str, Param(
            help="relative: given sigma, sigma0 in multiples of the layer's per-coordinate "
            "weight variance; absolute: as given", choices=VARIANCE_UNITS)] = "relative",
        backend: Annotated[str, Param(
            help="core: fusekit's C++ kernels; numpy: reference kernels and SciPy",
            choices=BACKENDS)] = "core",
        device: Device = "auto",
    ) -> FusionResult:
        """Match hidden neurons bottom-up and average matched neurons (posterior means).

        Residual networks (a GraphSpec) are matched group by group: see
        :func:`~fusekit.methods.bayesian.network.fuse_groups`; widths then apply per group.

        Args:
            width: fused width of every hidden layer (an int), one int per hidden layer (a
                list), or ``"unlimited"`` (the width the posterior infers, often close to
                the sum of the clients' widths). Each asked width must be at least the
                widest client's width in that layer. Default: ``width_ratio``.
            width_ratio: fused width relative to the widest client, per hidden layer
                (rounded half up, >= 1). Default 1.5 (:data:`DEFAULT_WIDTH_RATIO`) when neither
                width nor width_ratio is given; give at most one of the two.
            lam: weight lambda of NAFI's KL penalty (>= 0; 0 is PFNM's cost). Default: 0 for
                ``pfnm``, 0.01 (:data:`DEFAULT_LAMBDA`) for ``nafi``.
            sigma: client noise variance sigma_s^2: one value, or one per client (given to
                ``fusekit.fuse`` in the order of its inputs; this method receives them in
                the canonical client order, as ``report["clients"]`` lists it), in units set
                by variance_units. Default: estimated per layer (empirical Bayes, reported
                in ``report["layers"][l]["hyperparameters"]``).
            sigma0: prior variance sigma0^2 of global neurons, same units. Default: estimated.
            gamma: Beta-process mass gamma0 (> 0); larger opens new neurons more readily.
                Default: estimated.
            mu0: prior mean of the global neurons (weight units).
            sweeps: refinement sweeps after the greedy pass (T), and after the width is
                imposed.
            seed: seeds the client order of the sweeps (layer l uses seed + l).
            class_share: outgoing weights get precision f_sk/sigma^2 and the output layer
                class-share weights; default: on when every client has class counts.
            class_weights: the per-class client weights class_share uses: "information"
                (g_sk proportional to N_sk (1 - N_sk / N_s), the one-against-the-rest
                information of client s's labels, ALGORITHMS.md §3) or "counts" (f_sk =
                N_sk / sum_s N_sk, NAFI Algorithm 2).
            unobserved: "mask" (coordinates a client lacks have precision 0, ALGORITHMS §2)
                or "zeros" (observed zeros at full precision, as the authors' code does).
            variance_units: units of a given sigma / sigma0: "relative" (multiples of the
                per-coordinate weight variance of the layer's neuron vectors, per block) or
                "absolute".
            backend: "core" (C++ kernels) or "numpy" (reference kernels + SciPy).
            device: where the core backend's cost matrices are computed: "auto" (a CUDA
                device for the large ones, when present), "cpu" or "cuda[:N]"
                (:func:`~fusekit.methods.base.places_cost_kernels`).

        Raises:
            IncompatibleModelsError: PAN checkpoints (use avg).
            ParameterError: out-of-range parameters, a width below the widest client.
        """
        params = BayesianParams(
            lam=self.default_lam if lam is None else float(lam), width=as_width(width),
            width_ratio=width_ratio, sigma=as_sigma(sigma), sigma0=sigma0, gamma=gamma,
            mu0=mu0, sweeps=sweeps, seed=seed, class_share=class_share,
            class_weights=class_weights,
            unobserved=unobserved, variance_units=variance_units, backend=backend,
        )
        if isinstance(specs[0], TransformerSpec):
            fuse = fuse_transformer_mlps
        else:
            fuse = fuse_groups if isinstance(specs[0], GraphSpec) else fuse_network
        state_dict, fused_spec, report, assignments = fuse(checkpoints, specs, params, self.name)
        return self.result(state_dict, checkpoints, fused_spec, params.as_json(), report,
                           assignments)


@register
class PFNM(BayesianMatching):
    name = "pfnm"
    summary = "Bayesian nonparametric neuron matching (PFNM); fused width 1.5x by default"


@register
class NAFI(BayesianMatching):
    name = "nafi"
    summary = "PFNM with the KL penalty of NAFI (neural aggregation with full information)"
    default_lam = DEFAULT_LAMBDA
