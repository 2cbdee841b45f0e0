"""What a service process needs to know: where its data lives, its queue, its limits.

API servers and workers read the same settings; ``fusekit serve`` passes them to the
workers it starts through the environment (``FUSEKIT_*`` variables), so a worker on another
machine is configured the same way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from fusekit.core.checkpoint import VALUE_CHECK_BYTES
from fusekit.core.errors import ParameterError
from fusekit.core.stats import DEFAULT_MIN_SAMPLES

GiB = 1024**3


@dataclass(frozen=True)
class Settings:
    """One service's configuration.

    Attributes:
        data_dir: jobs, uploads, results, the SQLite queue and admin.token live here; shared
            by every API server and worker of one service (a network file system when they
            run on several machines).
        broker: ``""`` for the SQLite queue in ``data_dir`` (one machine), or a Redis URL
            (``redis://host:6379/0``) for workers on several machines.
        max_checkpoint_bytes: the largest upload a job may accept (a job may ask for less).
        max_uploads: uploads one API server receives at once; more get 429.
        max_jobs: jobs the service keeps (deleted ones do not count); more get 429.
        lease_s: a running job whose worker has not signalled for this long is taken to be
            dead and is run again, from the step it was in (its fusion, or its current
            calibration round, with the files received): at most ``max_attempts`` runs of
            each step.
        upload_idle_s: an upload that sends nothing for this long is abandoned.
        upload_min_rate: bytes per second an upload must average once its first
            ``upload_idle_s`` seconds are over (``size >= rate * (elapsed - idle_s)``),
            else it is abandoned: a client trickling bytes cannot hold an upload place.
        upload_check_bytes: memory one upload's value check works in (tensors are read in
            pieces), in a checker process; at most ``max_uploads`` checks run at once.
        min_stats_samples: a calibrating job refuses statistics files over fewer inputs
            (per-channel moments of a few samples come close to revealing them); a job
            keeps the value it was created with.
        max_job_memory: bytes one job's fusion may need (default: the machine's memory); a
            job whose fused widths need more, by the least its fusion can take, is refused
            when it is created.
    """

    data_dir: Path
    broker: str = ""
    max_checkpoint_bytes: int = 4 * GiB
    max_uploads: int = 16
    max_jobs: int = 1000
    lease_s: float = 30.0
    max_attempts: int = 3
    upload_idle_s: float = 60.0
    upload_min_rate: float = 100_000.0
    upload_check_bytes: int = VALUE_CHECK_BYTES
    min_stats_samples: int = DEFAULT_MIN_SAMPLES
    max_job_memory: int = field(default_factory=lambda: physical_memory())

    def __post_init__(self) -> None:
        for name in ("max_checkpoint_bytes", "max_uploads", "max_jobs", "max_attempts",
                     "upload_check_bytes", "min_stats_samples", "max_job_memory"):
            if getattr(self, name) < 1:
                raise ParameterError(f"{name}: expected a positive integer, found "
                                     f"{getattr(self, name)}")
        for name in ("lease_s", "upload_idle_s", "upload_min_rate"):
            if not getattr(self, name) > 0:
                raise ParameterError(f"{name}: expected a number > 0, found "
                                     f"{getattr(self, name)}")
        if self.broker and not self.broker.startswith(("redis://", "rediss://", "unix://")):
            raise ParameterError(
                f"broker: expected a Redis URL (redis://host:port/db) or nothing for SQLite, "
                f"found {self.broker!r}")

    def to_env(self) -> dict[str, str]:
        """The settings as ``FUSEKIT_*`` variables, for the worker processes."""
        return {_env_name(f.name): str(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Settings:
        environ = dict(os.environ if environ is None else environ)
        values = {}
        for f in fields(cls):
            raw = environ.get(_env_name(f.name))
            if raw is None:
                continue
            kind = {"data_dir": Path, "broker": str, "lease_s": float,
                    "upload_idle_s": float, "upload_min_rate": float}.get(f.name, int)
            try:
                values[f.name] = kind(raw)
            except ValueError:
                raise ParameterError(
                    f"{_env_name(f.name)}: expected {kind.__name__}, found {raw!r}") from None
        if "data_dir" not in values:
            raise ParameterError("FUSEKIT_DATA_DIR: expected the service's data folder, unset")
        return cls(**values)


def physical_memory() -> int:
    """The machine's memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _env_name(field: str) -> str:
    return f"FUSEKIT_{field.upper()}"
