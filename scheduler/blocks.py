"""The mirror of one worker's KV pool: free blocks, references, and the prefix cache.

The scheduler is the single owner of block accounting; the worker only writes where a plan
tells it to. A block is referenced by the sequences whose tables hold it. With the prefix
cache on, a full, computed block is keyed by a hash chained over its parent's key, its
token ids and the model version; another sequence with the same prefix shares it. A block
nobody references goes back to the free list: plain blocks are handed out first, cached ones
stay reusable until they are evicted least-recently-used.

    key(block i) = H(key(block i-1), tokens[i*bs:(i+1)*bs])     key(-1) = H(model version)

A request's cache salt (a tenant: the gateway's --cache-isolation key) changes key(-1), so
tenants never share a block and cannot tell from cached_tokens what another sent. A LoRA
adapter is part of the salt too (scheduler/sequence.py ``prefix_salt``): the same tokens make
other KV under another adapter, so two adapters never share a block; one adapter's requests do.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

# The most blocks one worker's pool may have: the mirror holds a list entry per block.
MAX_NUM_BLOCKS = 1 << 21
# state_map: a block's character from whether it is referenced (0 or 1), and a cached one's
_STATE_OF_REFERENCED = bytes.maketrans(b"\x00\x01", b".U")
_CACHED = ord("C")


def chain_key(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_cache: bool = False,
        cache_salt: str = "",
    ) -> None:
        if not 0 < num_blocks <= MAX_NUM_BLOCKS:
            raise ValueError(f"num_blocks={num_blocks}: must be in 1..{MAX_NUM_BLOCKS}")
        if block_size <= 0:
            raise ValueError(f"block_size={block_size}: must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.root_key = hashlib.blake2b(cache_salt.encode(), digest_size=16).digest()
        self._plain: deque[int] = deque(range(num_blocks))  # free, no cached content
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free, cached, LRU first
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        # KV tiers: cached blocks handed out again, to copy down before they are rewritten
        self.keep_evicted = False
        self.evicted: list[tuple[int, bytes]] = []

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (plain free ones and evictable cached ones)."""
        return len(self._plain) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks kept for their cached content."""
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def refs(self, block: int) -> int:
        return self._refs[block]

    def state_map(self) -> str:
        """One character per block: 'U' referenced, 'C' free with a cached prefix, '.' free.
        Built with a pass in C over the references (a status page polls it every second,
        and a pool has up to millions of blocks), then the evictable ones marked."""
        states = bytearray(bytes(map(bool, self._refs)).translate(_STATE_OF_REFERENCED))
        for block in self._evictable:
            states[block] = _CACHED
        return states.decode("ascii")

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` blocks for new content, or None (and nothing taken) when too few are free."""
        if count > self.num_free:
            return None
        blocks = []
        for _ in range(count):
            if self._plain:
                block = self._plain.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)  # evict the least recent
                key = self._key_of.pop(block)
                del self._block_of[key]
                if self.keep_evicted:
                    self.evicted.append((block, key))
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drops one reference to each block; unreferenced ones become free (or evictable)."""
        for block in blocks:
            if self._refs[block] <= 0:
                raise ValueError(f"block {block} freed twice")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._evictable[block] = None
                else:
                    self._plain.append(block)

    # -- prefix cache --------------------------------------------------------------------

    def root_for(self, salt: str) -> bytes:
        """key(-1) of a tenant: the pool's own root, salted when ``salt`` is not empty."""
        if not salt:
            return self.root_key
        return hashlib.blake2b(self.root_key + salt.encode(), digest_size=16).digest()

    def match_prefix(self, tokens: list[int], salt: str = "") -> tuple[list[int], list[bytes]]:
        """References the cached blocks of the longest cached prefix of ``tokens``.

        At least one token is always left to compute, so the last token's logits exist.
        """
        if not self.enable_prefix_cache:
            return [], []
        bs = self.block_size
        blocks: list[int] = []
        keys: list[bytes] = []
        parent = self.root_for(salt)
        num_full = (len(tokens) - 1) // bs
        for i in range(num_full):
            key = chain_key(parent, tokens[i * bs : (i + 1) * bs])
            block = self._block_of.get(key)
            if block is None:
                break
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
            blocks.append(block)
            keys.append(key)
            parent = key
        return blocks, keys

    def count_cached_prefix(self, tokens: list[int], salt: str = "") -> int:
        """Leading full blocks of ``tokens`` cached here (what match_prefix would reuse)."""
        if not self.enable_prefix_cache:
            return 0
        bs = self.block_size
        parent = self.root_for(salt)
        for i in range((len(tokens) - 1) // bs):
            parent = chain_key(parent, tokens[i * bs : (i + 1) * bs])
            if parent not in self._block_of:
                return i
        return (len(tokens) - 1) // bs

    def has(self, key: bytes) -> bool:
        return key in self._block_of

    def take(self, key: bytes) -> int | None:
        """References the cached block of ``key``, if any (a prefix continuing past tier
        blocks into blocks still in the pool)."""
        block = self._block_of.get(key)
        if block is None:
            return None
        if self._refs[block] == 0:
            del self._evictable[block]
        self._refs[block] += 1
        return block

    def adopt(self, block: int, key: bytes) -> None:
        """Keys ``block``, which holds a reloaded tier block, unless the key is cached here."""
        if self.enable_prefix_cache and key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key

    def commit(self, block: int, parent: bytes, tokens: list[int]) -> bytes:
        """Records that ``block`` now holds ``tokens`` after ``parent``; returns its key."""
        key = chain_key(parent, tokens)
        if self.enable_prefix_cache and key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key
        return key
