"""The cache manager: who holds which slot, pages, prefix entries and checkpoints, over the pool and the
prefix tree, so that nobody above reaches into either.

`admit` gives a request a slot and the pages for its whole budget, resuming from the longest cached
prefix of its prompt (making room by eviction, starting host-tier loads); `release` takes them back.
`plan_checkpoints` reserves the prefix checkpoints an extend step takes at the page boundaries it
crosses, and `commit_prefill` enters the prefilled pages into the prefix cache after that step. Every
write to the pool outside a forward is journaled (`take_journal`) for the step plan, which the other ranks
of a tensor-parallel engine replay.
"""

from __future__ import annotations

import contextlib

from ..errors import RequestError
from ..step_plan import PoolEffect
from .host_tier import HostLoad, Loads
from .pool import StatePool
from .prefix import Hit, PrefixCache


class CacheManager:
    def __init__(self, pool: StatePool, *, prefix_cache: bool = True, host_cache_bytes: int = 0):
        self.pool = pool
        self.prefix = PrefixCache(pool, host_cache_bytes) if prefix_cache else None
        self.page_size = pool.page_size
        self.hits = self.hit_tokens = 0  # requests that resumed from the cache, and the tokens it served them
        self.host_hits = 0  # of those, the ones that loaded something back from the host tier
        self._journal: list[PoolEffect] = []
        self._loads: list = []  # (HostLoad, the Reload it carries out) admitted since the last extend step
        self._user_counter = None  # a layer-transfer counter attached by the caller

    # ---- requests ---------------------------------------------------------------------------------

    def check_fits(self, budget: int) -> None:
        """A RequestError if a request of `budget` tokens could never be admitted, even alone."""
        need = self.pool.pages_needed(budget)
        if need > self.pool.pages.capacity:
            raise RequestError(f"the request needs {need} KV pages but the pool has {self.pool.pages.capacity}; "
                               "lower max_new_tokens or enlarge num_pages")

    def admit(self, req) -> bool:
        """Gives the request a slot and pages, resuming from the longest cached prefix of its prompt
        (evicting unused cache entries if pages are short); False if it must wait."""
        pool, prefix = self.pool, self.prefix
        # A request scoring its prompt is prefilled whole: a cached prefix has no logprobs to give it.
        hit = prefix.lookup(req.prompt) if prefix is not None and not req.wants_prompt_logprobs else Hit(None, 0)
        if hit.entry is None:
            if not pool.can_admit(req.budget) and not (
                    prefix is not None and prefix.make_room(pages=pool.pages_needed(req.budget))
                    and pool.can_admit(req.budget)):
                return False
            self._allocate(req, [])
            return True
        path = hit.entry.path()
        if any(entry.loading for entry in path):
            return False  # its prefix is still coming back from the host for another request: next step
        prefix.acquire(hit)  # pinned first: making room must not evict what it resumes from
        host_pages, checkpoint_on_host = prefix.on_host(hit)  # to come back from the host tier
        shared = len(path) if pool.pages_needed(1) else 0
        pages = pool.pages_needed(req.budget) - shared + len(host_pages)
        if not prefix.make_room(pages=pages, checkpoints=int(checkpoint_on_host)) or \
                not pool.can_admit(req.budget, shared - len(host_pages)):
            prefix.release(hit.entry)
            return False
        reload = prefix.reserve_reload(hit)  # fresh device pages and checkpoint; the data follows
        slot = self._allocate(req, [e.page for e in path] if shared else [])
        if reload:
            self.host_hits += 1
            checkpoint = reload.checkpoint
            load = HostLoad(pool, [(e.host, e.page) for e in reload.pages],
                            (checkpoint.host, checkpoint.checkpoint) if checkpoint else None, slot)
            self._loads.append((load.start(), reload))
        if not checkpoint_on_host:
            pool.restore_checkpoint(slot, hit.entry.checkpoint)
            self._journal.append(PoolEffect("restore_checkpoint", [slot, hit.entry.checkpoint]))
        req.prefix_entry, req.prefilled, req.cached_tokens = hit.entry, hit.tokens, hit.tokens
        self.hits += 1
        self.hit_tokens += hit.tokens
        return True

    def _allocate(self, req, shared_pages: list[int]) -> int:
        slot = self.pool.allocate(req.request_id, req.budget, shared_pages)
        self._journal.append(PoolEffect("reset_slot", [slot, list(self.pool.pages_of[req.request_id])]))
        return slot

    def release(self, req) -> None:
        """The request's slot and pages go back (the pages it shares stay with the cache); the prefix it
        resumed from is unpinned."""
        slot = self.pool.slot_of[req.request_id]
        self.pool.free(req.request_id)
        self._journal.append(PoolEffect("clear_block_row", [slot]))
        if self.prefix is not None:
            self.prefix.release(req.prefix_entry)
        req.prefix_entry = None

    def slots_of(self, reqs: list) -> list[int]:
        slot_of = self.pool.slot_of
        return [slot_of[r.request_id] for r in reqs]

    # ---- prefill ----------------------------------------------------------------------------------

    def plan_checkpoints(self, chunks: list[tuple[object, int]]) -> list[dict[int, int]]:
        """Per chunk {pages: checkpoint index} for the page boundaries it crosses that the prefix cache
        has no checkpoint for yet, deepest first (a longer shared prefix saves more), as many as free or
        evictable checkpoints allow."""
        planned: list[dict[int, int]] = [{} for _ in chunks]
        if self.prefix is None:
            return planned
        for row, (req, n) in enumerate(chunks):
            for pages in range((req.prefilled + n) // self.page_size, req.prefilled // self.page_size, -1):
                if not self.prefix.needs_checkpoint(req.prompt, pages):
                    continue
                if not self.prefix.make_room(checkpoints=1):
                    return planned
                planned[row][pages] = self.pool.checkpoints.allocate(1)[0]
        return planned

    def commit_prefill(self, chunks: list[tuple[object, int]], planned: list[dict[int, int]]) -> None:
        """After an extend forward: each request's full prompt pages enter the prefix cache with the
        checkpoints taken at their boundaries (a failed request's checkpoints are dropped)."""
        for (req, n), checkpoints in zip(chunks, planned):
            if req.finish_reason == "error" or self.prefix is None:
                self.pool.checkpoints.free(list(checkpoints.values()))
                continue
            self.prefix.insert(req.prompt, (req.prefilled + n) // self.page_size, self.pool.pages_of[req.request_id],
                               dict(checkpoints))

    @property
    def loading(self) -> bool:
        """Whether requests admitted since the last extend step resume from prefixes coming back from host
        memory (that step's forward waits for them, and fails where a copy fails)."""
        return bool(self._loads)

    @contextlib.contextmanager
    def host_loads(self):
        """Around an extend forward: cached prefixes coming back from the host tier are the pool's
        layer-transfer counter (layer L waits for them); afterwards their entries live on the device again,
        or, for a load that failed, stay on the host and give their fresh pages and checkpoint back."""
        if self._loads:
            counters = [load for load, _ in self._loads]
            counters += [self._user_counter] if self._user_counter is not None else []
            self.pool.register_layer_transfer_counter(Loads(counters))
        try:
            yield
        finally:
            self.finish_loads()

    def finish_loads(self) -> None:
        for load, reload in self._loads:
            load.join()
            self.prefix.finish_reload(reload, ok=load.error is None)
        self._loads.clear()
        self.pool.register_layer_transfer_counter(self._user_counter)

    def attach_layer_transfer_counter(self, counter) -> None:
        self._user_counter = counter
        self.pool.register_layer_transfer_counter(counter)

    # ---- what the step plan carries, and what the engine reports ---------------------------------------

    def take_journal(self) -> list[PoolEffect]:
        """The pool writes made since the last call (for the next step plan)."""
        journal, self._journal = self._journal, []
        return journal

    def clear(self) -> int:
        return self.prefix.clear() if self.prefix is not None else 0

    def stats(self) -> dict:
        if self.prefix is None:
            return {}
        return {"prefix_hits": self.hits, "prefix_hit_tokens": self.hit_tokens}

    def usage(self) -> dict[str, int]:
        """Free slots and pages, and the pages and checkpoints the prefix cache holds."""
        pool, prefix = self.pool, self.prefix
        return {"slots_free": pool.slots.num_free, "pages_free": pool.pages.num_free,
                "pages_cached": prefix.device_pages if prefix is not None else 0,
                "checkpoints_free": pool.checkpoints.num_free}
