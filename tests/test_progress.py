import logging

from fusekit.core import progress


def test_steps_reach_a_listener_and_nothing_else():
    seen, logged = [], []

    class Root(logging.Handler):
        def emit(self, record):
            logged.append(record)

    root = Root()
    logging.getLogger().addHandler(root)
    try:
        progress.advance("layers matched", 1, 2)  # nobody listens: nothing happens
        handler = progress.listen(lambda *step: seen.append(step))
        progress.advance("layers matched", 2, 2)
        progress.stop_listening(handler)
        progress.advance("layers matched", 1, 2)
    finally:
        logging.getLogger().removeHandler(root)
    assert seen == [("layers matched", 2, 2)]
    assert not [r for r in logged if progress.progress_of(r)]  # not in the log's lines
    assert not progress.LOGGER.handlers and progress.LOGGER.propagate


def test_the_service_sends_the_first_last_and_few_steps():
    from fusekit.service.worker import _progress_sender

    class Pipe:
        def __init__(self):
            self.sent = []

        def send(self, message):
            self.sent.append(message)

    pipe = Pipe()
    send = _progress_sender(pipe)
    for done in range(1, 321):  # faster than PROGRESS_EVERY_S apart
        send("tensors averaged", done, 320)
    send("layers matched", 1, 2)
    assert pipe.sent[0] == ("progress", "fusing: 1 of 320 tensors averaged")
    assert ("progress", "fusing: 320 of 320 tensors averaged") in pipe.sent
    assert len(pipe.sent) <= 4
    send("layers matched", 2, 2)
    assert pipe.sent[-1] == ("progress", "fusing: layer 2 of 2 matched")
