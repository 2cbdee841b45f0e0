"""fusekit in a Flower federation (``pip install 'fusekit-oneshot[flower]'``).

Server side, in a ServerApp::

    from fusekit.flower import FusekitStrategy
    strategy = FusekitStrategy("pfnm", {"width": 150}, min_available_nodes=3)
    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=1,
                            evaluate_fn=strategy.evaluate_fn(dataset))

Client side, in a ClientApp: ``train_reply(model, num_examples, class_counts)`` is the reply's
content; ``global_model(msg.content)`` rebuilds the global model with its fused widths.
"""

from fusekit.flower.client import global_model, train_reply
from fusekit.flower.records import (
    ARCH,
    CLASS_COUNTS,
    NUM_EXAMPLES,
    WIDTHS,
    arrays_to_state_dict,
    state_dict_to_arrays,
)
from fusekit.flower.strategy import FusekitStrategy

__all__ = [
    "ARCH",
    "CLASS_COUNTS",
    "NUM_EXAMPLES",
    "WIDTHS",
    "FusekitStrategy",
    "arrays_to_state_dict",
    "global_model",
    "state_dict_to_arrays",
    "train_reply",
]
