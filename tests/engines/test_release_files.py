"""The engine loaders run the installed release's own files, or refuse by name: a copy of the package
found first on ``sys.path`` (a source checkout), or an installed file edited after install (skipped
for an engine not installed)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import re
import shutil
import sys
import threading
from pathlib import Path

import pytest

from kvstate.engines import sglang_loader, vllm_loader
from kvstate.engines._loading import EngineVersionError

LOADERS = [pytest.param(module.LOADER, id=module.LOADER.package,
                        marks=pytest.mark.skipif(module.installed_version() is None,
                                                 reason=f"{module.LOADER.package} is not installed"))
           for module in (sglang_loader, vllm_loader)]


def _fresh(loader):
    """The same lists with nothing loaded yet, so ``load()`` runs its checks again in this process."""
    return dataclasses.replace(loader, _loaded={}, _lock=threading.Lock())


def _installed_folder(loader) -> Path:
    return Path(importlib.metadata.distribution(loader.package).locate_file(loader.package))


def _copy_with_one_byte_edited(loader, into: Path) -> Path:
    """The real files copied to ``into/<package>/`` as a package; the last one, the cache itself, gets
    one byte changed inside a comment, so it still compiles and only the loader's check can stop it."""
    for name in loader.real:
        relative = Path(*name.split(".")[1:]).with_suffix(".py")
        (into / loader.package / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_installed_folder(loader) / relative, into / loader.package / relative)
    (into / loader.package / "__init__.py").write_text("")
    edited = into / loader.package / relative
    data = edited.read_bytes()
    at = data.index(b"# ") + 1
    edited.write_bytes(data[:at] + b"!" + data[at + 1:])
    return edited


def _first_on_sys_path(monkeypatch, loader, folder: Path) -> None:
    monkeypatch.syspath_prepend(str(folder))
    for name in [name for name in sys.modules if loader._owns(name)]:    # find_spec would answer from these
        monkeypatch.delitem(sys.modules, name)


@pytest.mark.parametrize("loader", LOADERS)
def test_a_copy_first_on_sys_path_is_refused_by_its_path(loader, tmp_path, monkeypatch):
    _copy_with_one_byte_edited(loader, tmp_path)
    _first_on_sys_path(monkeypatch, loader, tmp_path)
    shadow = os.path.realpath(tmp_path / loader.package)
    with pytest.raises(EngineVersionError, match=f"found at {re.escape(shadow)}, not at"):
        _fresh(loader).load()


@pytest.mark.parametrize("loader", LOADERS)
def test_an_installed_file_edited_after_install_is_refused_by_its_hash(loader, tmp_path, monkeypatch):
    """The copy is installed as the release (its dist-info, RECORD included, copied beside it), so the
    folder is the distribution's and only the RECORD's sha256 tells the edited file apart."""
    edited = _copy_with_one_byte_edited(loader, tmp_path)
    installed = importlib.metadata.distribution(loader.package)
    dist_info = tmp_path / f"{loader.package}-{loader.version}.dist-info"
    dist_info.mkdir()
    for name in ("METADATA", "RECORD"):
        (dist_info / name).write_text(installed.read_text(name))
    _first_on_sys_path(monkeypatch, loader, tmp_path)
    with pytest.raises(EngineVersionError, match=f"{re.escape(os.path.realpath(edited))} is not .*RECORD"):
        _fresh(loader).load()


@pytest.mark.parametrize("loader", LOADERS)
def test_the_installed_release_loads_from_its_own_folder(loader):
    folder = os.path.realpath(_installed_folder(loader))
    modules = _fresh(loader).load()
    assert sorted(modules) == sorted(loader.real)
    assert all(os.path.realpath(module.__file__).startswith(folder + os.sep) for module in modules.values())
