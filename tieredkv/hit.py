"""PrefixHit: what ``TieredCache.lookup`` found, and the codes that say which level holds each block."""

from __future__ import annotations

import dataclasses

import numpy as np

from tieredkv.keys import ChunkKeys

#: ``PrefixHit.where`` codes of the standard levels (``tieredkv.levels.entries`` gives them; a level of
#: your own has its own, from 3 up).
HOT, WARM, REMOTE = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """The result of ``lookup``: how much of a prompt's prefix the tiers hold, and where.

    Attributes:
        tokens: cached prefix length in tokens (a multiple of ``chunk_tokens``, always < the prompt).
        prompt_tokens: the prompt's length.
        keys: the keys of the hit blocks.
        where: per hit block, the code of the level holding it: ``HOT`` (0), ``WARM`` (1), ``REMOTE``
            (2), or a level of your own (3 up).
    """

    tokens: int
    prompt_tokens: int
    keys: ChunkKeys
    where: np.ndarray

    @property
    def blocks(self) -> int:
        return len(self.keys)

    def blocks_in(self, code: int) -> int:
        """How many hit blocks the level with this code holds."""
        return int(np.count_nonzero(self.where == code))

    @property
    def hot_blocks(self) -> int:
        return self.blocks_in(HOT)

    @property
    def warm_blocks(self) -> int:
        return self.blocks_in(WARM)

    @property
    def remote_blocks(self) -> int:
        return self.blocks_in(REMOTE)

    @property
    def prefill_tokens(self) -> int:
        """Tokens the model still has to compute."""
        return self.prompt_tokens - self.tokens
