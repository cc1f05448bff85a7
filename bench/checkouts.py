"""A benchmark's serving loop run in another checkout's code, in its own process, round by round.

How ``--against DIR`` works in ``one_token_pages``, ``extend`` and ``read_pages``: the benchmark's
own file is run by path (the other checkout may not have it) with ``--serve ROUNDS`` and its
arguments, importing kvstate from DIR; each line written to it starts one round, and it answers
with that round's figures as one line of JSON, so the two checkouts' rounds interleave and load
hits both alike. Each benchmark declares ``--against`` and ``--serve`` itself, and imports this
module only on the side that starts the child: the child's ``kvstate`` is DIR's, whose
``checkouts`` may be older than this one or missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

FOLDERS = ("spec", "impl", "reference", "stateful", "fuzz", "bench", "model")


def importable(checkout: Path, folder: Path) -> Path:
    """A folder from which ``import kvstate`` finds ``checkout``'s code, whichever packaging it used
    (older commits mapped the top-level folders into kvstate through setuptools)."""
    package = folder / "kvstate"
    package.mkdir(parents=True)
    for item in (checkout / "kvstate").iterdir():
        if item.suffix == ".py":
            (package / item.name).symlink_to(item.resolve())
    for name in FOLDERS:
        if (checkout / name).is_dir():
            (package / name).symlink_to((checkout / name).resolve())
    return folder


def serve_in(checkout: Path, script: Path, arguments: list[str], scratch: Path) -> subprocess.Popen:
    """``script --serve ...arguments`` running on ``checkout``'s kvstate (``scratch``: an empty folder)."""
    path = importable(checkout.resolve(), scratch)
    serve = (f"import runpy, sys; sys.argv = ['-', *{arguments!r}]; "
             f"runpy.run_path({str(script)!r}, run_name='__main__')")
    return subprocess.Popen([sys.executable, "-c", serve], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(path)), cwd=scratch)


def next_round(child: subprocess.Popen):
    """One more round from ``child``: its figures, as the JSON it printed."""
    child.stdin.write("go\n")
    child.stdin.flush()
    return json.loads(child.stdout.readline())


def finish(children) -> None:
    for child in children:
        child.stdin.close()
        child.wait()
