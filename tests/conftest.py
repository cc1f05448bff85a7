import gc

import pytest

# Scheduling only, never correctness: the longest tests (whole conform runs, lockstep machines
# over several configurations, exhaustive scopes, CrossHair and other subprocesses) go first, so
# that under ``--dist worksteal`` (pyproject.toml) the suite ends on short tests that the two
# workers share, instead of one worker running a long test alone at the end. Ordered by the
# per-test durations of a full run (``pytest --durations=80``); a test not named here keeps its
# place after them, and a name that no longer matches anything costs nothing. Files whose
# module-scoped fixtures start a server or a cluster (test_remote, test_sweep_cluster,
# test_model_hf) are left whole, so their fixture starts once per worker, not once per group.
LONGEST_FIRST = (
    "tests/test_conform.py::test_torch_backend_conforms_on_cpu",
    "tests/test_bug_zoo.py::test_correct_foreign_backend_passes_with_nothing_rejected",
    "tests/test_examples_tiers.py::test_example_passes_with_the_tiers_it_lacks_reported_na",
    "tests/test_planted_bugs.py::test_engine_passes_what_conform_runs",
    "tests/test_spec_arithmetic.py::test_property_crosshair_backend",
    "tests/test_exhaustive.py::test_engine_passes_the_default_scope",
    "tests/test_exhaustive.py::test_planted_semantics_bug_is_found_with_a_minimal_trace",
    "tests/test_exhaustive.py::test_engine_passes_each_declared_semantics_at_the_default_depth",
    "tests/test_lockstep.py::",
    "tests/test_conform.py::test_pytest_plugin_runs_conformance_as_test_items",
    "tests/test_hf_cache.py::test_restore_in_a_new_process",
    "tests/test_spec_arithmetic.py::test_crosshair",
    "tests/test_exhaustive.py::test_planted_bug_is_found_with_a_minimal_trace",
    "tests/test_bench_smoke.py::test_fork_allocates_and_copies_nothing",
    "tests/test_verdict.py::test_a_correct_backend_built_otherwise_passes_the_default_profile",
    "tests/test_bug_zoo.py::test_default_sequences_catch_the_bug_and_name_it",
    "tests/test_static_imports.py::test_a_type_checker_resolves_every_kvstate_import",
    "tests/test_hostile_inputs.py::test_hostile_calls_are_done_or_refused_by_name",
    "tests/test_races.py::test_observe_while_other_threads_write_sees_consistent_structure",
    "tests/test_exhaustive.py::test_engine_passes_a_complete_tiny_scope",
    "tests/test_hardening.py::test_deeply_nested_entries_observe_and_check",
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


def pytest_collection_finish(session):
    # Speed only, never correctness: what collection built (the imports, every test item and its
    # parameters: ~240,000 tracked objects) lives for the whole session, so it is moved out of
    # the collector's reach instead of being traversed by every full collection. On the heaviest
    # tests the collector's time fell from 2.9 to 1.5 s a minute; objects made later are
    # collected as before.
    gc.collect()
    gc.freeze()


def pytest_generate_tests(metafunc):
    # ``machine_config``: one test per machine configuration. Imported here, not at the top: the
    # xdist controller loads this file too, before it starts the workers, and never collects, so
    # it need not import (and assertion-rewrite) Hypothesis and the suite first (~1.2 s CPU).
    if "machine_config" in metafunc.fixturenames:
        from kvstate.stateful.configs import machine_configs

        metafunc.parametrize("machine_config", machine_configs(), ids=lambda c: c.name)
