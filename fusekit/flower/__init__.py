"""fusekit in a Flower federation (``pip install 'fusekit-oneshot[flower]'``).

Server side, in a ServerApp::

    from fusekit.flower import FusekitStrategy, log_to_flower
    log_to_flower()  # fusekit's INFO lines among Flower's
    strategy = FusekitStrategy("pfnm", min_available_nodes=3)
    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=3,
                            evaluate_fn=strategy.evaluate_fn(dataset))
    fused = strategy.global_checkpoint(result.arrays)

Client side, in a ClientApp: ``train_reply(model, num_examples, class_counts)`` is the reply's
content; ``global_model(msg.content)`` rebuilds the global model with its fused widths (the
message's ConfigRecord has ``fusekit-widths`` once a round fused). With
``FusekitStrategy(..., calibrate=True)`` the ClientApp also answers calibration's query::

    @app.query(STATISTICS)  # "statistics"
    def statistics(msg, context):
        return Message(statistics_reply(msg.content, my_training_inputs), reply_to=msg)

With ``alignment_rounds=N`` the same query also asks for statistics against the model the
node trained: keep it with ``train_reply(..., keep_in=context.state)`` and answer with
``statistics_reply(msg.content, my_training_inputs, own_model=kept_model(context.state))``.
"""

from typing import TYPE_CHECKING

from fusekit.core.lazy import lazy_names

if TYPE_CHECKING:
    from fusekit.flower.client import global_model, statistics_reply, train_reply
    from fusekit.flower.logs import log_to_flower
    from fusekit.flower.records import (
        ARCH,
        CLASS_COUNTS,
        NUM_EXAMPLES,
        STATISTICS,
        WIDTHS,
        arrays_to_state_dict,
        kept_model,
        state_dict_to_arrays,
    )
    from fusekit.flower.strategy import FusekitStrategy

# Each name is imported from its module on first use, as fusekit's own: a process that
# needs one module of this package (a SuperExec, fusekit.flower.superexec) does not import
# torch and the strategy with it.
_HOMES = {
    **dict.fromkeys(("global_model", "statistics_reply", "train_reply"), "fusekit.flower.client"),
    "log_to_flower": "fusekit.flower.logs",
    **dict.fromkeys(("ARCH", "CLASS_COUNTS", "NUM_EXAMPLES", "STATISTICS", "WIDTHS",
                     "arrays_to_state_dict", "kept_model", "state_dict_to_arrays"),
                    "fusekit.flower.records"),
    "FusekitStrategy": "fusekit.flower.strategy",
}

__all__ = [
    "ARCH",
    "CLASS_COUNTS",
    "NUM_EXAMPLES",
    "STATISTICS",
    "WIDTHS",
    "FusekitStrategy",
    "arrays_to_state_dict",
    "global_model",
    "kept_model",
    "log_to_flower",
    "state_dict_to_arrays",
    "statistics_reply",
    "train_reply",
]


__getattr__, __dir__ = lazy_names(__name__, _HOMES, globals())
