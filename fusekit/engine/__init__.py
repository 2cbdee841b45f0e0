"""The matching engine: :mod:`fusekit.engine.matching` is the only door to the compiled core
(``fusekit._core``); :mod:`fusekit.engine.reference` holds the numpy reference kernels."""
