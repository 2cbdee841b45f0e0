"""What surrounds fusion: torch modules, data sets, client training, simulation, evaluation and
the demo. The toolkit imports the core, the engine and the methods; none of them imports it.

Importing the toolkit gives ``--method distill`` its training stage, a torch loop the
torch-free methods may not import, and the engine its cost kernels on a CUDA device
(:mod:`fusekit.toolkit.costs`); ``fusekit.fuse`` imports the toolkit for both."""

from typing import Any

from fusekit.engine.offload import Accelerator, set_accelerator
from fusekit.methods.distill import set_student_trainer


def _train_student(task: Any) -> Any:
    from fusekit.toolkit.distill import train_student  # torch loads when a distillation runs

    return train_student(task)


set_student_trainer(_train_student)


def _accelerator(device: str) -> Accelerator | None:
    from fusekit.toolkit.costs import accelerator  # torch loads when a device is asked for

    return accelerator(device)


set_accelerator(_accelerator)
