"""A dict that empties itself once it outgrows a limit: the one bound of every module cache.

ampkit keeps small caches keyed by values a user may rebuild every step (a fresh policy,
say). Each must stay bounded without paying for eviction bookkeeping on the hot path: a
lookup is a plain ``dict.get``; a store past the limit clears the whole cache first, and
the entries are rebuilt on their next miss.

>>> cache = BoundedCache(2)
>>> for k in "abc":
...     _ = cache.put(k, k.upper())
>>> sorted(cache)
['a', 'b', 'c']
>>> cache.put("d", "D") and sorted(cache)
['d']
"""

from __future__ import annotations


class BoundedCache(dict):
    """A dict whose :meth:`put` clears it first when it holds more than ``limit`` entries."""

    __slots__ = ("limit",)

    def __init__(self, limit: int):
        super().__init__()
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"BoundedCache: limit must be a positive int, got {limit!r}")
        self.limit = limit

    def put(self, key, value):
        """Store ``value`` under ``key`` (emptying the cache first when it is full); returns ``value``."""
        if len(self) > self.limit:
            self.clear()
        self[key] = value
        return value
