"""Foreign backends: engines written from README.md and ``kvstate.spec`` alone, as a backend author would.

They import only ``kvstate.spec`` and NumPy (never ``kvstate.impl`` or ``kvstate.reference``), so
``kvstate conform`` is tested on code that shares nothing with ours. ``bugs.py`` plants one bug per
subclass in them; ``tests/test_bug_zoo.py`` asserts conform catches each and passes the originals.
"""
