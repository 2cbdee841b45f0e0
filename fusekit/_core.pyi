"""Type stubs for fusekit's compiled core (csrc/bindings.cpp)."""

import numpy as np
import numpy.typing as npt

Floats = npt.NDArray[np.float64]

SINGLE_PRECISION_FLOPS: float

def solve_assignment(
    cost: np.ndarray, return_duals: bool = False, negated: bool = False
) -> tuple[
    npt.NDArray[np.int64],
    npt.NDArray[np.int64],
    npt.NDArray[np.float64] | None,
    npt.NDArray[np.float64] | None,
]: ...
def sqeuclidean_cost(
    a: npt.NDArray[np.float64], b: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]: ...
def posterior_cost(
    local: npt.NDArray[np.float64],
    client_precision: npt.NDArray[np.float64],
    global_sums: npt.NDArray[np.float64],
    global_precisions: npt.NDArray[np.float64],
    global_counts: npt.NDArray[np.float64],
    mu0: npt.NDArray[np.float64],
    sigma0_2: npt.NDArray[np.float64],
    n_clients: float,
    gamma0: float,
    lam: float,
) -> npt.NDArray[np.float64]: ...
def add_rows(
    target: npt.NDArray[np.float64],
    rows: npt.NDArray[np.int64],
    values: npt.NDArray[np.float64],
    sign: float = 1.0,
    scale: npt.NDArray[np.float64] | None = None,
) -> None: ...
def add_moments(
    sums: Floats, squares: Floats, counts: Floats, rows: npt.NDArray[np.int64],
    values: Floats, scale: Floats, seen: Floats,
) -> None: ...
def log_det_rows(client_precision: Floats, global_precisions: Floats) -> Floats: ...
def finite_min(x: npt.NDArray[np.float64]) -> float: ...
def has_openmp() -> bool: ...
