"""The worker's own checks of every plan entry: defence in depth behind the scheduler.

The scheduler owns block accounting, but the worker does not take its word for what a block
holds. It keeps, per block, how many live sequences hold it and, once it computed a full
block, a key chained over the tokens written there (the scheme of the scheduler's prefix
cache, without its salt):

    key(block i of a sequence) = H(key(block i-1), tokens of block i)
    key(block -1) = zeros for the base model, H(adapter id, its sha256) for a LoRA adapter

So a new sequence may claim ``num_cached_tokens`` only over blocks whose keys equal the chain
of its own tokens, and every block it will write must be held by no other live sequence: a
sequence never attends to KV it was not given with its own tokens. Token ids are checked
against the vocabulary and sampling values against the bounds the gateway uses. A bad entry
fails only its own sequence (``EntryError``); the rest of the step runs.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from canteen.adapters import AdapterRef
from canteen.plan import NewSequence

_ROOT_KEY = b"\0" * 16


def root_key(adapter: AdapterRef | None) -> bytes:
    """Where a sequence's chain starts: its adapter's KV differs from the base's."""
    if adapter is None:
        return _ROOT_KEY
    seed = f"{adapter.id}\0{adapter.sha256}".encode()
    return hashlib.blake2b(seed, digest_size=16).digest()


class EntryError(ValueError):
    """One plan entry the worker cannot apply; it fails only the sequence it names."""

    def __init__(self, seq_id: str, reason: str) -> None:
        super().__init__(f"sequence {seq_id}: {reason}")
        self.seq_id = seq_id


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockLedger:
    """Who holds each block and what each full computed block contains."""

    def __init__(self, num_blocks: int, block_size: int, vocab_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self._holders = [0] * num_blocks
        self._keys: dict[int, bytes] = {}

    def check_new(self, new: NewSequence) -> list[bytes]:
        """The keys of ``new``'s cached blocks; raises EntryError unless it may start on its
        blocks with that cached prefix."""
        bs, cached = self.block_size, new.num_cached_tokens
        if not new.token_ids:
            raise EntryError(new.seq_id, "has no tokens")
        bad = next((t for t in new.token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise EntryError(
                new.seq_id, f"token id {bad} outside the vocabulary of {self.vocab_size}"
            )
        if (problem := new.sampling.problem()) is not None:
            raise EntryError(new.seq_id, problem)
        if not 0 <= cached < len(new.token_ids) or cached % bs or cached > len(new.block_ids) * bs:
            raise EntryError(
                new.seq_id,
                f"num_cached_tokens={cached}: must be a multiple of {bs} below its "
                f"{len(new.token_ids)} tokens, within its {len(new.block_ids)} blocks",
            )
        self._check_fresh(new.seq_id, new.block_ids[cached // bs :], new.block_ids[: cached // bs])
        keys: list[bytes] = []
        root = root_key(new.adapter)
        for i, block in enumerate(new.block_ids[: cached // bs]):
            keys.append(chain_key(keys[-1] if keys else root, new.token_ids[i * bs : (i + 1) * bs]))
            if self._keys.get(block) != keys[-1]:
                raise EntryError(
                    new.seq_id,
                    f"block {block} does not hold its tokens {i * bs}..{(i + 1) * bs - 1} "
                    "(num_cached_tokens claims it does)",
                )
        return keys

    def check_more(self, seq_id: str, held: Sequence[int], fresh: Sequence[int]) -> None:
        """Raises EntryError unless ``fresh`` blocks may be appended to a table ``held``."""
        self._check_fresh(seq_id, fresh, held)

    def _check_fresh(self, seq_id: str, fresh: Sequence[int], held: Sequence[int]) -> None:
        seen = set(held)
        for block in fresh:
            if not 0 <= block < self.num_blocks:
                raise EntryError(seq_id, f"block id {block} outside the pool of {self.num_blocks}")
            if block in seen or self._holders[block]:
                raise EntryError(seq_id, f"block {block} is already held by a live sequence")
            seen.add(block)
        bad = next((b for b in held if not 0 <= b < self.num_blocks), None)
        if bad is not None:
            raise EntryError(seq_id, f"block id {bad} outside the pool of {self.num_blocks}")

    def hold(self, block_ids: Sequence[int]) -> None:
        for block in block_ids:
            self._holders[block] += 1

    def release(self, block_ids: Sequence[int]) -> None:
        for block in block_ids:
            self._holders[block] -= 1

    def is_held(self, block: int) -> bool:
        return self._holders[block] > 0

    def key_of(self, block: int) -> bytes | None:
        """The content key of a full block computed (or reloaded) here, if any."""
        return self._keys.get(block)

    def loaded(self, block: int, key: bytes) -> None:
        """``block`` now holds content reloaded from a KV tier, whose chain key is ``key``."""
        self._keys[block] = key

    def release_all(self) -> None:
        """A new Run stream: no sequence holds anything (computed contents stay known)."""
        self._holders = [0] * self.num_blocks

    def will_write(self, block_ids: Sequence[int], start: int, end: int) -> None:
        """Forgets what blocks covering positions ``start..end-1`` held: they are rewritten."""
        bs = self.block_size
        for i in range(start // bs, (end - 1) // bs + 1):
            self._keys.pop(block_ids[i], None)

    def computed(
        self,
        block_ids: Sequence[int],
        tokens: Sequence[int],
        keys: list[bytes],
        end: int,
        root: bytes = _ROOT_KEY,
    ) -> None:
        """Records the keys of blocks that became full with the first ``end`` tokens;
        ``keys`` is the sequence's chain so far (from ``root``), extended in place."""
        bs = self.block_size
        while (len(keys) + 1) * bs <= end:
            i = len(keys)
            key = chain_key(keys[-1] if keys else root, tokens[i * bs : (i + 1) * bs])
            keys.append(key)
            self._keys[block_ids[i]] = key
