"""A job's states, and how a message says each: ``job ID has failed``, never ``is failed``.

Needs nothing beyond Python: ``fusekit.client`` reads them too.
"""

STATES = ("collecting", "queued", "running", "calibrating", "succeeded", "failed", "cancelled")
FINISHED = ("succeeded", "failed", "cancelled")

_IN_WORDS = {
    "collecting": "is collecting checkpoints",
    "queued": "is queued",
    "running": "is running",
    "calibrating": "is calibrating",
    "succeeded": "has succeeded",
    "failed": "has failed",
    "cancelled": "was cancelled",
}


def job_in_state(job_id: str, state: str) -> str:
    """The opening of a message about a job's state: ``job ID has failed``."""
    return f"job {job_id} {_IN_WORDS.get(state, f'is {state}')}"
