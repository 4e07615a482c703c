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
checkpoints run short.
"""

from __future__ import annotations

import dataclasses
import itertools

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

    def path(self) -> list[PrefixEntry]:
        """The entries from the first page down to this one."""
        entries, e = [], self
        while e.parent is not None:
            entries.append(e)
            e = e.parent
        return entries[::-1]


@dataclasses.dataclass
class Hit:
    entry: PrefixEntry | None  # None: nothing to resume from
    tokens: int  # prompt tokens served from the cache (the entry's boundary)
    pages: list[int]  # the shared KV pages above the boundary


class PrefixCache:
    def __init__(self, pool: StatePool):
        self.pool, self.page_size = pool, pool.page_size
        self.root = PrefixEntry(None, (), 0, None)
        self._clock = itertools.count(1)
        self.hits = self.hit_tokens = 0  # requests that resumed from the cache, and the tokens it served them

    def _page(self, prompt: list[int], i: int) -> tuple[int, ...]:
        return tuple(prompt[i * self.page_size:(i + 1) * self.page_size])

    def lookup(self, prompt: list[int]) -> Hit:
        """The longest checkpointed prefix of `prompt` that leaves at least one token to prefill."""
        entry, best = self.root, None
        for i in range((len(prompt) - 1) // self.page_size):
            entry = entry.children.get(self._page(prompt, i))
            if entry is None:
                break
            if entry.checkpoint is not None:
                best = entry
        if best is None:
            return Hit(None, 0, [])
        path = best.path()
        pages = [e.page for e in path] if best.page is not None else []
        return Hit(best, best.depth * self.page_size, pages)

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
        return entry is None or entry.checkpoint is None

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
                child = entry.children[key] = PrefixEntry(entry, key, i + 1, page)
            checkpoint = checkpoints.pop(i + 1, None)
            if checkpoint is not None:
                if child.checkpoint is None:
                    child.checkpoint = checkpoint
                else:
                    self.pool.checkpoints.free([checkpoint])
            child.last_used = now
            entry = child
        self.pool.checkpoints.free(list(checkpoints.values()))  # boundaries past `pages`: not recorded

    def evictable(self) -> list[PrefixEntry]:
        """Entries no running request pinned and no other entry hangs from: least recently used first."""
        leaves, stack = [], list(self.root.children.values())
        while stack:
            e = stack.pop()
            if e.children:
                stack.extend(e.children.values())
            elif e.users == 0:
                leaves.append(e)
        return sorted(leaves, key=lambda e: e.last_used)

    def evict(self, entry: PrefixEntry) -> None:
        del entry.parent.children[entry.tokens]
        if entry.page is not None:
            self.pool.release_page(entry.page)
        if entry.checkpoint is not None:
            self.pool.checkpoints.free([entry.checkpoint])

    def make_room(self, pages: int = 0, checkpoints: int = 0) -> bool:
        """Evicts until `pages` pages and `checkpoints` checkpoints are free; whether they are. Evicts
        nothing if even evicting every unpinned entry would not free enough (an entry's page may be
        held by a running request too, and then evicting it frees none)."""
        def short() -> bool:
            return self.pool.pages.num_free < pages or self.pool.checkpoints.num_free < checkpoints

        if not short():
            return True
        unpinned = [e for e in self.entries() if e.users == 0]
        freeable_pages = sum(e.page is not None and self.pool.page_refs[e.page] == 1 for e in unpinned)
        freeable_checkpoints = sum(e.checkpoint is not None for e in unpinned)
        if (self.pool.pages.num_free + freeable_pages < pages
                or self.pool.checkpoints.num_free + freeable_checkpoints < checkpoints):
            return False
        while short():
            leaves = self.evictable()
            if not leaves:
                return False
            for e in leaves:
                self.evict(e)
                if not short():
                    break
        return True

    def entries(self) -> list[PrefixEntry]:
        found, stack = [], list(self.root.children.values())
        while stack:
            e = stack.pop()
            found.append(e)
            stack.extend(e.children.values())
        return found
