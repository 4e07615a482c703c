"""Free lists for slots and pages. Index 0 is reserved as the dummy every padded row may write."""

from __future__ import annotations


class IndexAllocator:
    def __init__(self, capacity: int, what: str):
        self.capacity = capacity  # usable indices 1..capacity
        self.what = what
        self._free = list(range(capacity, 0, -1))  # pop() hands out the lowest index first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"{self.what} pool exhausted: asked for {n}, {len(self._free)} free of {self.capacity}")
        return [self._free.pop() for _ in range(n)]

    def free(self, indices: list[int]) -> None:
        self._free.extend(reversed(indices))
