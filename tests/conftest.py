import pytest

from kvstate.stateful.configs import machine_configs

# Scheduling only, never correctness: the longest tests (each a whole conform run, a lockstep
# machine over several configurations, or a CrossHair subprocess) go first, so that under
# ``--dist worksteal`` (pyproject.toml) the suite ends on short tests that the two workers
# share, instead of one worker running a long test alone at the end. A test not named here
# keeps its place after them; a name that no longer matches anything costs nothing.
LONGEST_FIRST = (
    "tests/test_page_recycling.py::test_the_lockstep_machine_holds_with_every_page_recycled",
    "tests/test_verdict.py::test_a_correct_backend_built_otherwise_passes_the_default_profile",
    "tests/test_sweep.py::test_a_sweep_covers_every_configuration_the_backend_declares",
    "tests/test_spec_arithmetic.py::test_crosshair",
    "tests/test_planted_bugs.py::test_unplanted_engine_passes_the_hunt_profile",
    "tests/test_planted_bugs.py::test_planted_bug_is_caught",
    "tests/test_lockstep.py::",
    "tests/test_bug_zoo.py::test_correct_foreign_backend_passes_with_nothing_rejected",
    "tests/test_conform.py::test_torch_backend_conforms_on_cpu",
    "tests/test_conform.py::test_pytest_plugin_runs_conformance_as_test_items",
    "tests/test_conform.py::test_example_backend_passes_every_check",
    "tests/test_spec_arithmetic.py::test_property_crosshair_backend",
    "tests/test_bug_zoo.py::test_default_sequences_catch_the_bug_and_name_it",
    "tests/test_races.py::",
    "tests/test_exhaustive.py::",
)


def _rank(item) -> int:
    return next((i for i, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)),
                len(LONGEST_FIRST))


@pytest.hookimpl(trylast=True)      # after pytest's own reordering, so the order below is final
def pytest_collection_modifyitems(config, items):
    items.sort(key=_rank)      # stable: within a rank, and for every other test, pytest's order
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA device; none is present")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(params=machine_configs(), ids=lambda c: c.name)
def machine_config(request):
    return request.param
