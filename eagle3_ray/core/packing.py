"""Greedy packing in arrival order, the one packer of the project: generate's work units (tokens), shards (bytes)
and the online stream's training batches (tokens).

    groups = greedy_groups(sizes, budget)          # indices, consecutive items together
    groups = interleaved_groups(sizes, budget)     # indices, consecutive items in different groups
"""

from __future__ import annotations


class GreedyPacker:
    """Greedy packing in arrival order: items go into the open group until the next would pass `budget`; an item
    larger than the budget gets a group of its own. The one packer of the project: generate's work units (tokens),
    shards (bytes) and the online stream's training batches (tokens).

        packer = GreedyPacker(budget)
        for item, size in items:
            if (group := packer.add(item, size)) is not None: use(group)
        use(packer.flush())   # the last, possibly partial group ([] when nothing is left)
    """

    def __init__(self, budget: int):
        self.budget = budget
        self.items: list = []
        self.used = 0

    def add(self, item, size: int) -> list | None:
        """Adds `item`; returns the group it closed (the items before it), or None."""
        closed = self.flush() if self.items and self.used + size > self.budget else None
        self.items.append(item)
        self.used += size
        return closed

    def flush(self) -> list:
        group, self.items, self.used = self.items, [], 0
        return group


def greedy_groups(sizes: list[int], budget: int) -> list[list[int]]:
    """Indices of `sizes` grouped by GreedyPacker."""
    packer, groups = GreedyPacker(budget), []
    for i, size in enumerate(sizes):
        if (group := packer.add(i, size)) is not None:
            groups.append(group)
    return groups + ([last] if (last := packer.flush()) else [])


def interleaved_groups(sizes: list[int], budget: int) -> list[list[int]]:
    """As many groups as greedy_groups makes (more when needed to keep each within `budget`), filled round-robin:
    item i goes to group i % k. Consecutive items land in different groups: samples that finish together (requests
    finish roughly in the order they were sent) are written into different shard files at once, where writes into
    one file wait on each other (the kernel serializes buffered writes to one file)."""
    k = len(greedy_groups(sizes, budget))
    while True:
        groups = [list(range(j, len(sizes), k)) for j in range(k)]
        if all(len(g) == 1 or sum(sizes[i] for i in g) <= budget for g in groups):
            return groups
        k += 1
