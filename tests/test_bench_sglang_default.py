"""``versus_sglang_default``: kvstate beside the tree SGLang's scheduler builds by default
(``UnifiedRadixCache`` over its Rust TreeCore). Its loader refuses another release or a missing
dependency by name; the benchmark runs where SGLang's dependencies are installed and says why not
where they are not (no timing is asserted)."""

import importlib.metadata
import subprocess
import sys

import pytest

from kvstate.bench import versus_sglang, versus_sglang_default
from kvstate.engines import sglang_default_loader
from kvstate.engines._loading import EngineVersionError


def test_the_loader_refuses_another_release_and_an_absent_sglang_by_name(monkeypatch):
    sglang_default_loader.load_default_tree.cache_clear()       # a success earlier in this process is not asked again
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.5.22")
    with pytest.raises(EngineVersionError, match=r"SGLang 0\.5\.22 is installed; .* for 0\.5\.23 only: pip install"):
        sglang_default_loader.load_default_tree()

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", absent)
    with pytest.raises(ImportError, match=r"SGLang is not installed: pip install --no-deps sglang==0\.5\.23 pybase64"):
        sglang_default_loader.load_default_tree()


def test_the_torchvision_stand_in_gives_names_and_refuses_calls():
    """What serves SGLang's one torchvision import where none is installed: reads give stand-ins (a
    default argument reads ``InterpolationMode``), a call raises and is recorded as every stand-in use is."""
    from kvstate.engines._loading import STAND_IN_USES, StandInCalled

    module = sglang_default_loader._TorchvisionStandIn().create_module(
        importlib.machinery.ModuleSpec("torchvision.transforms", None))
    mode = module.InterpolationMode.BICUBIC
    assert "torchvision.transforms.InterpolationMode" in sglang_default_loader.TORCHVISION_READS
    before = len(STAND_IN_USES)
    with pytest.raises(StandInCalled, match="torchvision.transforms.InterpolationMode.BICUBIC is a stand-in"):
        mode()
    assert STAND_IN_USES[before:] == ["torchvision.transforms.InterpolationMode.BICUBIC"]
    del STAND_IN_USES[before:]      # this test's own call, not a run's
    with pytest.raises(AttributeError):
        module.__version__      # transformers reads a version this way: none, so no torchvision is claimed


def test_the_default_tree_is_the_peer_every_kvstate_row_is_judged_against():
    """``verdict`` on made-up rows: the targets and hit checks name the default tree, the legacy
    RadixCache's hits are checked against it, and a kvstate row's ratio is the one given."""
    def row(engine, given, lookup, matched=10):
        return {"workload": "divergent", "page": 16, "engine": engine, "input": given, "matched": matched,
                "lookup_us": 10.0, "insert_us": 10.0, "lookup_speedup": lookup, "insert_speedup": 3.0,
                "lookup_floor_us": 1.0, "lookup_floor_speedup": 10.0}

    peer = versus_sglang_default.SGLANG_DEFAULT
    rows = [row(peer, "array('q')", 1), row(peer, "Python list", 0.5), row("SGLang RadixCache", "array('q')", 0.6),
            row("kvstate block", "int64 array", 1.2), row("kvstate token", "int64 array", 1.6, matched=12)]
    out = versus_sglang.verdict(rows, timed=True, peer_engine=peer, design=versus_sglang_default.DESIGN)
    assert out[f"divergent @16 {peer}, Python list: hit = its array('q') row's"] is True
    assert out[f"divergent @16 SGLang RadixCache, array('q'): hit = {peer}'s"] is True
    assert out["divergent @16 kvstate block, int64 array: hit = SGLang's"] is True
    assert out["divergent @16 kvstate block, int64 array: min(lookup, insert speedup) >= 1.5"] == "1.20 MISSED"
    assert out["divergent @16 kvstate token, int64 array: min(lookup, insert speedup) >= 1.5"] == "1.60 met"
    # a miss above its floor against the compiled tree names no design as measured to pass
    assert "design that passes: none built or measured against a compiled tree" in out[
        "divergent @16 kvstate block, int64 array: lookup 1.20 MISSED"]
    assert "pages as slabs: one allocation" in versus_sglang.verdict(rows, timed=True, peer_engine=peer)[
        "divergent @16 kvstate block, int64 array: lookup 1.20 MISSED"]      # versus_sglang's own designs
    rows[2]["matched"] = 9      # the legacy tree matching otherwise is caught, not averaged away
    assert versus_sglang.verdict(rows, timed=True, peer_engine=peer)[
        f"divergent @16 SGLang RadixCache, array('q'): hit = {peer}'s"] is False


def test_the_benchmark_runs_against_the_default_tree_or_names_what_is_missing(capsys):
    """Without SGLang's dependencies (CI installs the release alone) it exits 1 naming each missing
    package and the install line, importing none of SGLang (so here, in this process); with them, in a
    process of its own (importing SGLang patches transformers there), it prints every row, each SGLang
    tree and kvstate input matching what the default tree matched."""
    args = ["--quick", "--page", "1", "--page", "16"]
    missing = sglang_default_loader.missing_dependencies()
    if missing:         # only then may it decline
        before = {name for name in sys.modules if name.split(".")[0] == "sglang"}
        assert versus_sglang_default.main(args) == 1
        out = capsys.readouterr().out
        assert out.startswith("SGLang's default tree cannot be loaded: ")
        assert all(pin in out for pin in missing) and sglang_default_loader.INSTALL in out
        assert {name for name in sys.modules if name.split(".")[0] == "sglang"} == before      # none imported
        return
    run = subprocess.run([sys.executable, "-m", "kvstate.bench.versus_sglang_default", *args],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    peer = versus_sglang_default.SGLANG_DEFAULT
    for kind in ("shared", "divergent"):
        for page in (1, 16):
            assert f"{kind} @{page} SGLang RadixCache, array('q'): hit = {peer}'s: True" in run.stdout
            assert f"{kind} @{page} {peer}, Python list: hit = its array('q') row's: True" in run.stdout
            matched = "token" if page == 1 else "block"
            for given in ("int64 array", "Python list", versus_sglang.TOKEN_IDS):
                assert f"{kind} @{page} kvstate {matched}, {given}: hit = SGLang's: True" in run.stdout
            assert f"{versus_sglang_default.COMMAND} --workload {kind} --page {page} --quick" in run.stdout
    assert ": False" not in run.stdout


def test_files_that_are_not_the_releases_own_are_refused(monkeypatch, tmp_path):
    """What ``load_default_tree`` checks once SGLang is imported, on modules put in ``sys.modules`` by
    hand (nothing of SGLang runs): one outside the installed package, and one whose bytes differ."""
    if sglang_default_loader.importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")
    distribution = importlib.metadata.distribution("sglang")
    folder = sglang_default_loader._package_folder(sglang_default_loader.LOADER, distribution)
    real = sys.modules.get("sglang.srt.mem_cache.radix_cache")
    module = type(sys)("sglang.srt.mem_cache.radix_cache")
    module.__file__ = f"{folder}/srt/mem_cache/radix_cache.py"
    monkeypatch.setitem(sys.modules, "sglang.srt.mem_cache.radix_cache", module)
    sglang_default_loader._check_release_files(distribution, folder)      # the installed file: accepted
    monkeypatch.setattr(sglang_default_loader, "_record_sha256", lambda data: "edited")
    with pytest.raises(EngineVersionError, match="radix_cache.py is not SGLang 0.5.23's file: its sha256 edited"):
        sglang_default_loader._check_release_files(distribution, folder)
    monkeypatch.undo()
    elsewhere = tmp_path / "radix_cache.py"
    elsewhere.write_text("")
    module.__file__ = str(elsewhere)
    monkeypatch.setitem(sys.modules, "sglang.srt.mem_cache.radix_cache", module)
    with pytest.raises(EngineVersionError, match="its RECORD does not list it"):
        sglang_default_loader._check_release_files(distribution, folder)
    monkeypatch.undo()
    assert sys.modules.get("sglang.srt.mem_cache.radix_cache") is real
