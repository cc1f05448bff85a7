"""The hostile storage fuzzer (``fuzz/hostile_storage.py``) at CI size, more with ``-m slow``; what it
found, as regression tests; and planted faults each target must report, so each is shown able to fail."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstate.fuzz import hostile_storage as HS
from kvstate.fuzz.hostile_inputs import Finding, Tally
from kvstate.impl import remote_io
from kvstate.impl.cache import Cache
from kvstate.spec.errors import KVStateError

CI = settings(max_examples=30, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
SLOW = settings(max_examples=1000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
URL_ARGS = (st.sampled_from(["memory", "file"]), HS.names(), st.none() | HS.credentials(), HS.secrets(), st.booleans())


@CI
@given(*URL_ARGS)
def test_hostile_urls_land_at_their_key_or_are_refused_leaving_nothing(tmp_path_factory, scheme, name, userinfo,
                                                                       secret, store):
    tally = Tally()
    HS.check_url(tally, scheme, name, userinfo, secret, str(tmp_path_factory.mktemp("u")), store)
    assert not tally.findings


@CI
@given(HS.tier_values(""), HS.tier_queries())
def test_hostile_second_tiers_are_refused_at_construction_or_never_break_match(value, query):
    tally = Tally()
    HS.check_tier(tally, value, query)
    assert not tally.findings


@CI
@given(HS.store_arguments())
def test_hostile_store_arguments_are_refused_by_name_or_round_trip(args):
    tally = Tally()
    HS.check_store_arguments(tally, args)
    assert not tally.findings


@pytest.mark.slow
@SLOW
@given(*URL_ARGS)
def test_hostile_urls_long(tmp_path_factory, scheme, name, userinfo, secret, store):
    tally = Tally()
    HS.check_url(tally, scheme, name, userinfo, secret, str(tmp_path_factory.mktemp("u")), store)
    assert not tally.findings


@pytest.mark.slow
@SLOW
@given(HS.tier_values(""), HS.tier_queries())
def test_hostile_second_tiers_long(value, query):
    tally = Tally()
    HS.check_tier(tally, value, query)
    assert not tally.findings


# -- what the fuzzer found ----------------------------------------------------------------------

SECRET = "wJalr/XUtn+FEMI=K7MDENG"


@pytest.mark.parametrize("userinfo", [f"AKIA:{SECRET}@", "tok3n+=x@"])
def test_a_file_url_carrying_credentials_is_refused_and_its_secret_never_shown(tmp_path, userinfo):
    """fsspec reads file://user:secret@/p as a relative path: the secret became a folder name in the message."""
    secret = SECRET if ":" in userinfo else "tok3n+=x"
    cache = Cache(HS.LAYOUT, page_tokens=HS.PAGE_TOKENS)
    ctx = HS._filled(cache, [1, 2], 0)
    url = f"file://{userinfo}{tmp_path}/x.kvs"
    for action in (lambda: ctx.snapshot(url), lambda: cache.restore(url)):
        with pytest.raises(KVStateError) as caught:
            action()
        assert secret not in HS._texts(caught.value)
    assert not list(tmp_path.iterdir())


def test_the_snapshot_store_class_as_a_tier_is_refused_at_construction():
    """The class has a callable consult: accepted, every match then raised TypeError."""
    from kvstate.remote import SnapshotStore
    from kvstate.spec.errors import ConfigError
    with pytest.raises(ConfigError, match="the class SnapshotStore"):
        Cache(HS.LAYOUT, page_tokens=HS.PAGE_TOKENS, second_tier=SnapshotStore)


@pytest.mark.parametrize("error", [RuntimeError("down"), OSError("down"), KVStateError("down")])
def test_a_tier_whose_consult_raises_costs_match_nothing_but_a_warning(error):
    from kvstate.spec.errors import SecondTierWarning
    cache = Cache(HS.LAYOUT, page_tokens=HS.PAGE_TOKENS, second_tier=HS.Raising(error))
    with HS._filled(cache, [1, 2, 3], 0) as local:
        cache.retain(local)
    with pytest.warns(SecondTierWarning, match=type(error).__name__):
        ctx, n = cache.match([1, 2, 3, 4])
    assert n == 3 and list(ctx.tokens) == [1, 2, 3]
    ctx.close()


def test_a_tier_interrupted_in_consult_lets_the_local_hit_go():
    """An interrupt (not an Exception) from a duck tier propagates, and the hit match had forked for
    the caller, who never receives it, is closed: nothing is left live after a clear."""
    cache = Cache(HS.LAYOUT, page_tokens=HS.PAGE_TOKENS, second_tier=HS.Raising(KeyboardInterrupt("^C")))
    with HS._filled(cache, [1, 2, 3], 0) as local:
        cache.retain(local)
    with pytest.raises(KeyboardInterrupt):
        cache.match([1, 2, 3, 4])
    cache.clear()
    after = cache.observe()
    assert after.pages == {} and after.holders == {}


# -- each target can fail -------------------------------------------------------------------------

def test_the_url_target_reports_a_secret_in_a_message(tmp_path, monkeypatch):
    monkeypatch.setattr(remote_io, "redact", lambda url: url)
    monkeypatch.setattr(remote_io, "refuse_credentials", lambda url, error_class: None)
    with pytest.raises(Finding, match="secret"):
        HS.check_url(Tally(), "memory", ("edge", ""), ("user:secret@", "AKIAFUZZ:{secret}@"), "Sk/+=Qz",
                     str(tmp_path), False)


def test_the_url_target_reports_a_write_that_landed_elsewhere(tmp_path, monkeypatch):
    real = remote_io.open_publish

    def elsewhere(url, storage_options=None, worker=None):
        return real(url.replace(".kvs", "-moved.kvs") if url.count(".kvs") else url + "-moved", storage_options, worker)
    monkeypatch.setattr(remote_io, "open_publish", elsewhere)
    monkeypatch.setattr(remote_io, "_retried", lambda action, *args: action())
    with pytest.raises(Finding, match="restore"):
        HS.check_url(Tally(), "memory", ("pieces", "x.kvs"), None, "Sk/+=Qz", str(tmp_path), False)


def test_the_url_target_reports_a_partial_left_behind(tmp_path, monkeypatch):
    monkeypatch.setattr(remote_io, "_remove_quietly", lambda fs, path: None)
    monkeypatch.setattr(remote_io, "_abandon", lambda file: None)
    monkeypatch.setattr("kvstate.impl.snapshot_write._write_to", lambda file, ctx: (file.write(b"x"), 1 / 0))
    with pytest.raises(Finding):
        HS.check_url(Tally(), "memory", ("pieces", "x.kvs"), None, "Sk/+=Qz", str(tmp_path), False)


def test_the_tier_target_reports_a_match_that_raises(monkeypatch):
    """A tier that closes the local hit and then fails: match cannot fall back, so it raises."""
    from kvstate import remote

    def consumes_then_fails(self, cache, tokens, found):
        found[0].close()
        raise OSError("planted")
    monkeypatch.setattr(remote.SnapshotStore, "consult", consumes_then_fails)
    with pytest.raises(Finding, match="raised OSError"):
        HS.check_tier(Tally(), ("SnapshotStore holding garbage", lambda: _store("garbage")), "list")


def test_the_tier_target_reports_a_hit_of_other_tokens(monkeypatch):
    """A store serving an object whose tokens are not its key's (the check in get removed)."""
    from kvstate import remote

    def serve_anything(self, cache, tokens, longer_than=0, deadline_s=None):
        ctx = cache.allocate()
        ctx.extend([9] * 8, HS.np.ones(HS.LAYOUT.batch_shape(8), HS.np.float32))
        return ctx, 8, None         # no damaged object passed over
    monkeypatch.setattr(remote.SnapshotStore, "_get", serve_anything)     # what get and the tier both use
    with pytest.raises(Finding, match="returned 8 positions"):
        HS.check_tier(Tally(), ("SnapshotStore holding other tokens", lambda: _store("other tokens")), "list")


def _store(kind):
    import uuid

    from kvstate.remote import SnapshotStore
    store = SnapshotStore(f"memory://kvfuzz-test-{uuid.uuid4().hex[:8]}", stride=4)
    HS._plant(store, kind)
    return store


def test_the_store_arguments_target_reports_an_unchecked_stride(monkeypatch):
    """Without the constructor's check, stride 0 reaches put's division."""
    from kvstate import remote
    real = remote.SnapshotStore.__init__

    def unchecked(self, url_prefix, stride=4, probe_batch=8, storage_options=None, deadline_s=None):
        real(self, url_prefix, 4, probe_batch, storage_options, deadline_s)
        self.stride = stride
    monkeypatch.setattr(remote.SnapshotStore, "__init__", unchecked)
    with pytest.raises(Finding, match="unnamed ZeroDivisionError"):
        HS.check_store_arguments(Tally(), (0, 8, None))


# -- the URL target checks the keys after every step that returns ----------------------------------

class _OsCopyingReplace:
    """``os`` for ``impl/snapshot_files.py`` whose ``replace`` copies: the temporary file stays."""

    def __getattr__(self, name):
        import os
        return getattr(os, name)

    @staticmethod
    def replace(src, dst):
        import shutil
        shutil.copyfile(src, dst)


def _plant_temporary_left(monkeypatch, scheme):
    """A write that succeeds and leaves its temporary file: on file:// (a snapshot's or a put's: both go
    through ``write_atomic``), the rename a copy; on memory://, the temporary key never removed after
    the copy onto the target."""
    if scheme == "file":
        from kvstate.impl import snapshot_files
        monkeypatch.setattr(snapshot_files, "os", _OsCopyingReplace())
    else:
        monkeypatch.setattr(remote_io, "_remove_quietly", lambda fs, path: None)


@pytest.mark.parametrize("store", [False, True])
@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_the_url_target_reports_a_temporary_file_a_successful_write_left(tmp_path, monkeypatch, scheme, store):
    _plant_temporary_left(monkeypatch, scheme)
    with pytest.raises(Finding, match=r"(snapshot|put) returned but left a temporary file .*kvs-partial"):
        HS.check_url(Tally(), scheme, ("pieces", "x.kvs"), None, "Sk/+=Qz", str(tmp_path), store)


def test_the_url_target_reports_a_put_that_wrote_more_keys_than_it_reports(tmp_path, monkeypatch):
    from kvstate import remote
    real = remote.SnapshotStore.put
    monkeypatch.setattr(remote.SnapshotStore, "put", lambda self, ctx, deadline_s=None: real(self, ctx)[:1])
    with pytest.raises(Finding, match="put returned but the new keys are .* not the 1 put reports"):
        HS.check_url(Tally(), "memory", ("pieces", "x"), None, "Sk/+=Qz", str(tmp_path), True)


def test_a_refusal_after_the_write_is_reported_as_such_not_as_the_write_left_behind(tmp_path, monkeypatch):
    """A restore refused after its URL's snapshot returned: the snapshot's file is the write's, not the
    restore's; the finding names the refusal, and nothing as "left"."""
    from kvstate.spec.errors import SnapshotNotFoundError

    def not_found(self, source, *args, **kwargs):
        raise SnapshotNotFoundError("planted: no snapshot there")
    monkeypatch.setattr(Cache, "restore", not_found)
    tally = Tally()
    with pytest.raises(Finding, match="restore refused .SnapshotNotFoundError.* after a write landed at"):
        HS.check_url(tally, "file", ("pieces", "x.kvs"), None, "Sk/+=Qz", str(tmp_path), False)
    assert not any("but left" in finding for finding in tally.findings), tally.findings


@pytest.mark.parametrize("name", [("pieces", "x.kvs"), ("edge", ".kvs-partial"), ("pieces", ".x.kvs-partial")])
@pytest.mark.parametrize("store", [False, True])
@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_the_url_target_passes_the_engine_as_it_is(tmp_path, scheme, store, name):
    """The cases above on the engine as shipped, and names shaped like a temporary file's (a legal
    snapshot name: the one key is then that name): stored, no finding."""
    tally = Tally()
    HS.check_url(tally, scheme, name, None, "Sk/+=Qz", str(tmp_path), store)
    assert not tally.findings and tally.refused == {"stored": 1}, (tally.findings, tally.refused)
