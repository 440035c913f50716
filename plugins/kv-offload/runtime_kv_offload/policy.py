"""Eviction policies of an offload tier's index: LRU and ARC (adaptive replacement cache).

A policy orders the resident keys; the tier asks it for a victim when it needs room,
skipping keys that ``can_evict`` refuses (blocks still being written or about to be loaded).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable


class LRUPolicy:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.resident: OrderedDict[Hashable, None] = OrderedDict()

    def __contains__(self, key) -> bool:
        return key in self.resident

    def __len__(self) -> int:
        return len(self.resident)

    def touch(self, key) -> None:
        self.resident.move_to_end(key)

    def insert(self, key) -> None:
        self.resident[key] = None

    def remove(self, key) -> None:
        """Forget a key that turned out bad (a failed read), without counting it as evicted."""
        self.resident.pop(key, None)

    def evict(self, can_evict: Callable[[Hashable], bool], incoming=None):
        """Remove and return the least recently used evictable key (None: every key is busy)."""
        for key in self.resident:
            if can_evict(key):
                del self.resident[key]
                return key
        return None


class ARCPolicy:
    """Megiddo & Modha's ARC: recency (T1) and frequency (T2) lists whose split adapts to
    hits on the ghost lists of recently evicted keys (B1, B2)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.p = 0.0  # target size of T1
        self.t1: OrderedDict = OrderedDict()
        self.t2: OrderedDict = OrderedDict()
        self.b1: OrderedDict = OrderedDict()
        self.b2: OrderedDict = OrderedDict()

    def __contains__(self, key) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def touch(self, key) -> None:
        """A hit: the key moves to the frequency list."""
        self.t1.pop(key, None)
        self.t2.pop(key, None)
        self.t2[key] = None

    def insert(self, key) -> None:
        c = self.capacity
        if key in self.b1:  # recency was evicted too early: favour T1
            self.p = min(c, self.p + max(len(self.b2) / len(self.b1), 1.0))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:  # frequency was evicted too early: favour T2
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        while len(self.t1) + len(self.b1) > c and self.b1:
            self.b1.popitem(last=False)
        while len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c and self.b2:
            self.b2.popitem(last=False)

    def remove(self, key) -> None:
        """Forget a key that turned out bad (a failed read): no ghost entry."""
        self.t1.pop(key, None)
        self.t2.pop(key, None)

    def evict(self, can_evict: Callable[[Hashable], bool], incoming=None):
        """ARC's REPLACE: the LRU end of T1 when T1 exceeds its target, else of T2 (the other
        list when the chosen one holds only busy keys); the victim joins its ghost list."""
        prefer_t1 = self.t1 and (len(self.t1) > self.p or (incoming in self.b2 and len(self.t1) == int(self.p)))
        order = ((self.t1, self.b1), (self.t2, self.b2)) if prefer_t1 else ((self.t2, self.b2), (self.t1, self.b1))
        for resident, ghost in order:
            for key in resident:
                if can_evict(key):
                    del resident[key]
                    ghost[key] = None
                    return key
        return None


POLICIES = {"lru": LRUPolicy, "arc": ARCPolicy}
