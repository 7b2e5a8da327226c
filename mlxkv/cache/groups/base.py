"""What every attention group's manager shares: its rule's questions, over its block tables.

A manager answers for one layer group (layer_groups.py) with one rule:
how long a prefix hit it accepts (`longest_hit`), which blocks a hit at b
needs (`needs`), how many blocks a sequence holds on its way to n tokens
(`peak_blocks`), and which blocks a running sequence may let go of
(`passed`). full.py and sliding.py are the two rules; recurrent.py is the
recurrent layers' manager, which holds states instead of blocks. The
coordinator (coordinator.py) asks each in turn and does the rest. A
manager's running sequences' block tables are its `tables` (tables.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxkv.cache.block_pool import Block, BlockPool
from mlxkv.cache.groups.tables import SequenceTables
from mlxkv.cache.hashing import BlockHash, group_hash
from mlxkv.cache.layer_groups import KVGroup
from mlxkv.cache.tiers import DISK


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class Presence:
    """Which block keys the pool or a tier holds, for one lookup: a tier is asked about a key once.

    `connector` None: the pool alone answers.
    """

    def __init__(self, pool: BlockPool, connector=None):
        self.pool = pool
        self.connector = connector
        self._tier: dict[BlockHash, str | bool] = {}  # key -> the tier that holds it, or False
        self.checkpoints: dict[BlockHash, bool] = {}  # checkpoint key -> whether a tier has it

    def tier(self, key: BlockHash) -> str:
        """The tier a key a lookup found comes from."""
        return self._tier[key]

    @property
    def use_tiers(self) -> bool:
        return self.connector is not None

    def leading(self, keys: list[BlockHash]) -> int:
        """How many leading keys the pool, then the tiers, hold."""
        n = 0
        while n < len(keys) and keys[n] in self.pool.cached:
            n += 1
        return n + self._tier_run(keys[n:])

    def first_absent(self, keys: list[BlockHash]) -> int | None:
        """The index of the first key nobody holds, or None."""
        absent = [i for i, key in enumerate(keys) if key not in self.pool.cached]
        supplied = self._tier_run([keys[i] for i in absent])
        return absent[supplied] if supplied < len(absent) else None

    def _tier_run(self, keys: list[BlockHash]) -> int:
        """How many leading keys a tier supplies, asking only about keys not answered yet."""
        n = 0
        while n < len(keys) and self._tier.get(keys[n]):
            n += 1
        if n == len(keys) or self.connector is None or keys[n] in self._tier:
            return n
        names = _tiers_of(self.connector, keys[n:])
        found = len(names)
        for key, name in zip(keys[n : n + found], names):
            self._tier[key] = name
        if n + found < len(keys):
            self._tier[keys[n + found]] = False
        return n + found


def _tiers_of(connector, keys: list[BlockHash]) -> list[str]:
    """The tier of each leading key the connector supplies (a tiered connector says; one tier is itself)."""
    tiers_of = getattr(connector, "tiers_of", None)
    if tiers_of is not None:
        return tiers_of(keys)
    return [getattr(connector, "tier_name", DISK)] * connector.get_computed_blocks(keys)


@dataclass
class GroupNeeds:
    """The blocks a hit needs from one group: those the pool holds, and those a tier supplies."""

    pool: list[tuple[int, Block]] = field(default_factory=list)  # (block index, pool block)
    tiers: list[tuple[int, BlockHash]] = field(default_factory=list)  # (block index, group key)


class AttentionManager:
    """One attention group's rule over its block tables; subclasses give the rule (full.py, sliding.py)."""

    def __init__(self, group: KVGroup, pool: BlockPool, block_size: int):
        self.group = group
        self.pool = pool
        self.block_size = block_size
        self.tables = SequenceTables()

    @property
    def index(self) -> int:
        return self.group.index

    def key(self, block_hash: BlockHash) -> BlockHash:
        return group_hash(block_hash, self.group.index)

    # -- the rule (subclasses) -------------------------------------------------

    def first_needed(self, position: int) -> int:
        """The first block the query at `position` (and any after it) attends to."""
        raise NotImplementedError

    def longest_hit(self, hashes: list[BlockHash], limit: int, presence: Presence) -> int:
        """The largest b <= limit for which the blocks this group needs are held somewhere."""
        raise NotImplementedError

    def slots_ahead(self) -> bool:
        """Whether a prompt's slots are all taken at admission (else a chunk at a time)."""
        raise NotImplementedError

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        raise NotImplementedError

    # -- a hit -----------------------------------------------------------------

    def needs(self, hashes: list[BlockHash], b: int) -> GroupNeeds:
        """What a hit at block b needs of this group, split into pool blocks and tier keys."""
        needs = GroupNeeds()
        for i in range(self.first_needed(b * self.block_size) if b else 0, b):
            key = self.key(hashes[i])
            block = self.pool.cached.get(key)
            if block is not None:
                needs.pool.append((i, block))
            else:
                needs.tiers.append((i, key))
        return needs

    def start(self, request_id: int, num_blocks: int, held: list[tuple[int, Block]]) -> None:
        """A sequence admitted on a hit of `num_blocks` blocks, holding these (index, block)s."""
        table: list[Block | None] = [None] * num_blocks
        for i, block in held:
            table[i] = block
        self.tables.start(request_id, table)

    # -- running ---------------------------------------------------------------

    def short(self, request_id: int, num_computed: int, num_new: int, ahead: int) -> int:
        """Blocks the table lacks for the next `num_new` tokens (+ `ahead`, if this rule takes them now)."""
        end = num_computed + num_new + (ahead if self.slots_ahead() else 0)
        return max(0, blocks_for(end, self.block_size) - len(self.tables.table(request_id)))

    def passed(self, request_id: int, num_computed: int, registered: int) -> list[int]:
        """Indices of held blocks the next token no longer needs (registered ones only)."""
        table = self.tables.table(request_id)
        end = min(self.first_needed(num_computed), len(table), registered)
        return [i for i in range(end) if table[i] is not None]

    def register(self, request_id: int, hashes: list[BlockHash], start: int, end: int) -> int:
        """Register the table's blocks start..end-1 under their keys; returns how many are waiting to be stored."""
        table = self.tables.table(request_id)
        held = [(b, self.key(h)) for b, h in zip(table[start:end], hashes[start:end]) if b is not None]
        newly = self.pool.register([b for b, _ in held], [key for _, key in held], self.group.index)
        return self.tables.add_unstored(request_id, newly)
