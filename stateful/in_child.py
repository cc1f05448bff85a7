"""A call run in a forked child process under a time limit, watched from this one.

A backend's factory may hang in C code that holds the GIL. In a thread of this process
(``deadline.in_daemon_thread``) it then holds every thread for good: the one that waits for it,
and the main thread, where a SIGTERM handler would run. In a child it holds only the child, which
is killed past the limit. Where processes cannot be forked (Windows) the call runs in a daemon
thread, as before.
"""

from __future__ import annotations

import multiprocessing
import sys
import time

from .deadline import Overran, in_daemon_thread
from .exits import ended_how

POLL_S = 0.2    # how often the wait looks at the child: a limit past what one poll can wait is fine


class ChildDied(Exception):
    """The child ended without an answer; ``how`` says how (an exit status, a signal) where known."""

    def __init__(self, how: str | None):
        super().__init__(how or "ended without an answer")
        self.how = how


def in_forked_child(call, seconds: float, name: str):
    """``call()`` in a forked child named ``name``: its result (which must pickle), or what it raised,
    re-raised here; past ``seconds``, ``Overran`` and the child is killed; ``ChildDied`` where the child
    ends without an answer (``os._exit``, a signal). The child is not daemonic: the call may start
    processes of its own. A signal handler of this process runs while it waits (a SIGTERM ends the
    wait, and the child with it)."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return in_daemon_thread(call, seconds, name)
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    sys.stdout.flush()
    sys.stderr.flush()
    child = context.Process(target=_answer, args=(call, send), name=name, daemon=False)
    child.start()
    send.close()
    try:
        kind, value = _wait(child, receive, seconds)
    finally:
        receive.close()
        if child.is_alive():
            child.kill()
        child.join()
    if kind == "error":
        raise value
    return value


def _answer(call, conn) -> None:
    try:
        answer = ("result", call())
    except BaseException as error:          # noqa: BLE001 -- handed to the parent, whatever it is
        answer = ("error", error)
    try:
        conn.send(answer)
    except Exception as error:              # noqa: BLE001 -- what did not pickle, named instead
        conn.send(("error", RuntimeError(f"the {answer[0]} could not be sent back: {error!r}")))


def _wait(child, receive, seconds: float) -> tuple[str, object]:
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise Overran(seconds, None)
        if receive.poll(min(left, POLL_S)):
            try:
                return receive.recv()
            except EOFError:
                break
        elif not child.is_alive() and not receive.poll(0):
            break
    child.join(5)
    raise ChildDied(ended_how(child.exitcode))
