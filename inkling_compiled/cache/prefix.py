"""Prefix cache: full pages of prompt tokens shared across requests, with the state at their boundaries.

A tree of entries, one per full page of some prompt, keyed by the page's tokens under its parent (so a
path from the root spells a prefix exactly: no hash can collide). Each entry holds

- the global layers' KV page of those tokens (a reference on the pool's page: shared, read-only), and
- where it could get one, a checkpoint: the whole per-request state at the entry's boundary (every conv
  window, every sliding ring), which is what a hybrid model needs beside the KV pages to resume there.

A request whose prompt starts with a cached prefix resumes from the deepest entry on its path that has
a checkpoint and leaves at least one prompt token to prefill: it shares the pages above that boundary,
copies the checkpoint into its own slot, and prefills the rest. Entries a running request started from
are pinned (`users`); the others are evicted leaf first, least recently used first, when pages or
checkpoints run short, in rounds: the current leaves least recently used first, then the entries their
eviction exposed. The candidates come from a heap ordered by last use, offered whenever an entry may
have become one (unpinned, a new leaf, a child evicted) and checked when taken, so that evicting costs
what it evicts, not a walk of the whole tree.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools

from .host_tier import HostCopy, copy_to_host, host_nbytes
from .pool import StatePool


@dataclasses.dataclass(eq=False)
class PrefixEntry:
    parent: PrefixEntry | None
    tokens: tuple[int, ...]  # this page's tokens
    depth: int  # pages from the root to here: the entry's boundary is depth * page_size
    page: int | None  # the global layers' KV page of these tokens (None without global layers)
    checkpoint: int | None = None  # the pool checkpoint holding the state at the boundary, if any
    children: dict[tuple[int, ...], PrefixEntry] = dataclasses.field(default_factory=dict)
    users: int = 0  # running requests that resumed from here or below
    last_used: int = 0
    host: HostCopy | None = None  # evicted to the host tier: page and checkpoint are None, the data is here
    loading: bool = False  # being copied back to its new page / checkpoint for a resuming request

    def path(self) -> list[PrefixEntry]:
        """The entries from the first page down to this one."""
        entries, e = [], self
        while e.parent is not None:
            entries.append(e)
            e = e.parent
        return entries[::-1]


@dataclasses.dataclass
class Reload:
    """What a hit brings back from the host tier: entries given fresh device pages, and the hit entry if
    it was given a fresh checkpoint; their data is still on the host until the copy is done."""
    pages: list[PrefixEntry]
    checkpoint: PrefixEntry | None

    def __bool__(self) -> bool:
        return bool(self.pages) or self.checkpoint is not None

    def entries(self) -> list[PrefixEntry]:
        """Each entry it touches, once."""
        extra = [self.checkpoint] if self.checkpoint is not None and self.checkpoint not in self.pages else []
        return self.pages + extra


@dataclasses.dataclass
class Hit:
    entry: PrefixEntry | None  # None: nothing to resume from
    tokens: int  # prompt tokens served from the cache (the entry's boundary)


class PrefixCache:
    def __init__(self, pool: StatePool, host_bytes: int = 0):
        self.pool, self.page_size = pool, pool.page_size
        self.host_bytes, self.host_used = host_bytes, 0  # the host tier's budget and what it holds
        self.root = PrefixEntry(None, (), 0, None)
        self._clock = itertools.count(1)
        # (last use, order, entry) of entries that may be evictable from the device / droppable from the host
        # tier; an item whose entry changed since it was pushed is skipped when it comes up.
        self._device_heap: list[tuple[int, int, PrefixEntry]] = []
        self._host_heap: list[tuple[int, int, PrefixEntry]] = []
        self._order = itertools.count()
        self.device_pages = 0  # KV pages the cache's entries hold on the device
        self.size = 0  # entries in the tree

    def _page(self, prompt: list[int], i: int) -> tuple[int, ...]:
        return tuple(prompt[i * self.page_size:(i + 1) * self.page_size])

    def lookup(self, prompt: list[int]) -> Hit:
        """The longest checkpointed prefix of `prompt` that leaves at least one token to prefill."""
        entry, best = self.root, None
        for i in range((len(prompt) - 1) // self.page_size):
            entry = entry.children.get(self._page(prompt, i))
            if entry is None:
                break
            if entry.checkpoint is not None or (entry.host is not None and entry.host.conv is not None):
                best = entry
        if best is None:
            return Hit(None, 0)
        return Hit(best, best.depth * self.page_size)

    def acquire(self, hit: Hit) -> None:
        """Pins the hit's path while a request that resumed from it runs."""
        now = next(self._clock)
        for e in hit.entry.path():
            e.users += 1
            e.last_used = now

    def release(self, entry: PrefixEntry | None) -> None:
        if entry is not None:
            for e in entry.path():
                e.users -= 1
                self._offer(e)

    # ---- eviction candidates ------------------------------------------------------------------------

    @staticmethod
    def _attached(e: PrefixEntry) -> bool:
        return e.parent is not None and e.parent.children.get(e.tokens) is e

    def _evictable(self, e: PrefixEntry, gone: set | frozenset = frozenset()) -> bool:
        """On the device, unpinned, not loading, and every child on the host tier (or in `gone`, evictions
        planned)."""
        return (e.host is None and e.users == 0 and not e.loading and self._attached(e)
                and all(c.host is not None or c in gone for c in e.children.values()))

    def _droppable(self, e: PrefixEntry) -> bool:
        """On the host tier, unpinned, not loading, a leaf."""
        return e.host is not None and e.users == 0 and not e.loading and not e.children and self._attached(e)

    def _offer(self, e: PrefixEntry | None) -> None:
        """The entry may have become a candidate: onto the heap of its tier if it is one."""
        if e is None or e.parent is None:
            return
        for heap, fits in ((self._device_heap, self._evictable), (self._host_heap, self._droppable)):
            if fits(e):
                heapq.heappush(heap, (e.last_used, next(self._order), e))
                if len(heap) > 2 * self.size + 64:  # mostly stale items (hits re-offer): keep the fresh ones
                    heap[:] = list({id(x): (stamp, order, x) for stamp, order, x in heap
                                    if stamp == x.last_used and fits(x)}.values())
                    heapq.heapify(heap)

    def entry_at(self, prompt: list[int], pages: int) -> PrefixEntry | None:
        """The entry of the first `pages` full pages of `prompt`, if cached."""
        entry = self.root
        for i in range(pages):
            entry = entry.children.get(self._page(prompt, i))
            if entry is None:
                return None
        return entry

    def needs_checkpoint(self, prompt: list[int], pages: int) -> bool:
        entry = self.entry_at(prompt, pages)
        return entry is None or (entry.checkpoint is None and (entry.host is None or entry.host.conv is None))

    def insert(self, prompt: list[int], pages: int, page_ids: list[int], checkpoints: dict[int, int]) -> None:
        """Records the first `pages` full pages of `prompt`, whose KV sits in `page_ids` (the request's own
        pages) and whose boundary states sit in `checkpoints` (pages -> checkpoint index); a checkpoint
        the cache has no use for (the entry already had one) is freed."""
        entry, now = self.root, next(self._clock)
        for i in range(pages):
            key = self._page(prompt, i)
            child = entry.children.get(key)
            if child is None:
                page = page_ids[i] if self.pool.pages_needed(1) else None
                if page is not None:
                    self.pool.retain_page(page)
                    self.device_pages += 1
                child = entry.children[key] = PrefixEntry(entry, key, i + 1, page)
                self.size += 1
            checkpoint = checkpoints.pop(i + 1, None)
            if child.host is not None and not child.loading and (checkpoint is not None or child.host.conv is None):
                # on the host tier, and this request has the same data on the device: adopt it
                page = page_ids[i] if self.pool.pages_needed(1) else None
                if page is not None:
                    self.pool.retain_page(page)
                    self.device_pages += 1
                child.page = page
                self.loaded(child)
                self._offer(child.parent)
            if checkpoint is not None:
                if child.checkpoint is None and child.host is None:
                    child.checkpoint = checkpoint
                else:
                    self.pool.checkpoints.free([checkpoint])
            child.last_used = now
            entry = child
        self.pool.checkpoints.free(list(checkpoints.values()))  # boundaries past `pages`: not recorded
        for e in entry.path():  # their last use changed: whichever are candidates go on again
            self._offer(e)

    def evictable(self) -> list[PrefixEntry]:
        """Device entries no running request pinned and no device entry hangs from (what hangs below
        them is on the host tier, if anything): least recently used first."""
        fresh = {id(e): e for stamp, _, e in sorted(self._device_heap) if stamp == e.last_used and self._evictable(e)}
        return list(fresh.values())

    def _release_device(self, entry: PrefixEntry) -> None:
        if entry.page is not None:
            self.pool.release_page(entry.page)
            self.device_pages -= 1
        if entry.checkpoint is not None:
            self.pool.checkpoints.free([entry.checkpoint])
        entry.page = entry.checkpoint = None

    def drop(self, entry: PrefixEntry) -> None:
        """Removes a leaf entry from the cache, wherever its data is."""
        parent = entry.parent
        del parent.children[entry.tokens]
        self.size -= 1
        self._release_device(entry)
        if entry.host is not None:
            self.host_used -= entry.host.nbytes
            entry.host = None
        self._offer(parent)

    def evict(self, entry: PrefixEntry) -> None:
        """Frees the entry's device page and checkpoint: its data moves to the host tier if that is on
        and has room (after dropping its least recently used leaves), else the entry goes."""
        if self.host_bytes and host_nbytes(self.pool, entry.page, entry.checkpoint) <= self.host_bytes:
            copy = copy_to_host(self.pool, entry.page, entry.checkpoint)
            self._release_device(entry)
            entry.host = copy
            self.host_used += copy.nbytes
            self._offer(entry)
            self._offer(entry.parent)
            self._trim_host(keep=entry)
            return
        self._drop_subtree(entry)

    def _drop_subtree(self, entry: PrefixEntry) -> None:
        """Drops the entry and everything below it (on the host tier, when this is called), deepest first."""
        for child in list(entry.children.values()):
            self._drop_subtree(child)
        self.drop(entry)

    def _trim_host(self, keep: PrefixEntry) -> None:
        """Drops host-tier leaves, least recently used first, until the tier fits its budget; `keep` (the
        entry just evicted to it) goes last."""
        kept = []
        while self.host_used > self.host_bytes and self._host_heap:
            item = heapq.heappop(self._host_heap)
            stamp, _, e = item
            if stamp != e.last_used or not self._droppable(e):
                continue
            if e is keep:
                kept.append(item)
                continue
            self.drop(e)
        for item in kept:
            heapq.heappush(self._host_heap, item)
        if self.host_used > self.host_bytes and self._droppable(keep):
            self.drop(keep)

    def loaded(self, entry: PrefixEntry) -> None:
        """The entry's data is back on the device (its new page and checkpoint): the host copy goes."""
        if entry.host is not None:
            self.host_used -= entry.host.nbytes
            entry.host = None

    @staticmethod
    def on_host(hit: Hit) -> tuple[list[PrefixEntry], bool]:
        """(entries on the hit's path whose page is on the host tier, whether the hit's checkpoint is)."""
        pages = [e for e in hit.entry.path() if e.host is not None and e.host.kv is not None]
        return pages, hit.entry.checkpoint is None

    def reserve_reload(self, hit: Hit) -> Reload:
        """Gives the hit's host-tier data fresh device pages and checkpoint (free ones: make room first)
        and marks those entries loading until `finish_reload`."""
        pages, checkpoint_on_host = self.on_host(hit)
        for entry in pages:
            entry.page = self.pool.pages.allocate(1)[0]
            self.pool.retain_page(entry.page)
            self.device_pages += 1
        if checkpoint_on_host:
            hit.entry.checkpoint = self.pool.checkpoints.allocate(1)[0]
        reload = Reload(pages, hit.entry if checkpoint_on_host else None)
        for entry in reload.entries():
            entry.loading = True
        return reload

    def finish_reload(self, reload: Reload, ok: bool) -> None:
        """The copy is over: the entries live on the device again, or, if it failed, their fresh pages and
        checkpoint go back and the data stays on the host."""
        for entry in reload.entries():
            entry.loading = False
            if ok:
                self.loaded(entry)
                self._offer(entry)
                continue
            if entry in reload.pages:
                self.pool.release_page(entry.page)
                self.device_pages -= 1
                entry.page = None
            if entry is reload.checkpoint:
                self.pool.checkpoints.free([entry.checkpoint])
                entry.checkpoint = None

    def clear(self) -> int:
        """Drops every entry no running request pinned, device and host alike; how many."""
        dropped = 0
        while leaves := [e for e in self.entries() if not e.children and e.users == 0]:
            for e in leaves:
                self.drop(e)
            dropped += len(leaves)
        return dropped

    def make_room(self, pages: int = 0, checkpoints: int = 0) -> bool:
        """Evicts until `pages` pages and `checkpoints` checkpoints are free; whether they are. Evicts
        nothing if even evicting every unpinned entry would not free enough (an entry's page may be
        held by a running request too, and then evicting it frees none)."""
        free_pages, free_checkpoints = self.pool.pages.num_free, self.pool.checkpoints.num_free
        if free_pages >= pages and free_checkpoints >= checkpoints:
            return True
        victims = self._plan_eviction(pages - free_pages, checkpoints - free_checkpoints)
        if victims is None:
            return False
        for e in victims:
            self.evict(e)
        return True

    def _plan_eviction(self, pages: int, checkpoints: int) -> list[PrefixEntry] | None:
        """The entries to evict, least recently used first, to free `pages` pages and `checkpoints`
        checkpoints; None (and the heap as it was) if evicting every candidate would not. An entry whose
        last device child is planned becomes a candidate itself."""
        victims, taken, gone, exposed = [], [], set(), []
        while pages > 0 or checkpoints > 0:
            if not self._device_heap and exposed:  # this round's leaves are used: the parents they exposed next
                for item in exposed:
                    heapq.heappush(self._device_heap, item)
                exposed = []
            if not self._device_heap:
                for item in taken:
                    heapq.heappush(self._device_heap, item)
                return None
            item = heapq.heappop(self._device_heap)
            stamp, _, e = item
            if e in gone or stamp != e.last_used or not self._evictable(e, gone):
                continue
            taken.append(item)
            victims.append(e)
            gone.add(e)
            pages -= e.page is not None and self.pool.page_refs[e.page] == 1
            checkpoints -= e.checkpoint is not None
            parent = e.parent
            if parent.parent is not None and self._evictable(parent, gone):
                exposed.append((parent.last_used, next(self._order), parent))
        return victims  # (the evictions offer the parents they expose: see drop and evict)

    def entries(self) -> list[PrefixEntry]:
        found, stack = [], list(self.root.children.values())
        while stack:
            e = stack.pop()
            found.append(e)
            stack.extend(e.children.values())
        return found
