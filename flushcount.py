import atexit, flush_reclaim
total = [0, 0]
_orig = flush_reclaim.FCache.make_room
def make_room(self, need_fn):
    before = self.flushes
    try:
        return _orig(self, need_fn)
    finally:
        total[0] += self.flushes - before
_init = flush_reclaim.FCache.__init__
def init(self, c):
    _init(self, c); total[1] += 1
flush_reclaim.FCache.make_room = make_room
flush_reclaim.FCache.__init__ = init
atexit.register(lambda: print(f"FLUSHES {total[0]} in {total[1]} caches"))
factory = flush_reclaim.factory
