"""A seeded synthetic trace of LLM requests: shared system prompts, multi-turn sessions, one-offs."""

from __future__ import annotations

import numpy as np

from tieredkv.errors import InvalidInput

from .trace import Trace

__all__ = ["synthetic_trace"]


def synthetic_trace(n_requests: int = 2000, *, seed: int = 0, n_system_prompts: int = 32,
                    system_blocks: tuple[int, int] = (8, 48), zipf_alpha: float = 1.1,
                    session_share: float = 0.6, new_session_prob: float = 0.2,
                    turn_blocks: tuple[int, int] = (1, 4), oneoff_blocks: tuple[int, int] = (2, 24),
                    max_session_blocks: int = 200) -> Trace:
    """Generate requests the way chat and agent traffic looks to a prefix cache.

    Every request starts with one of ``n_system_prompts`` shared system prompts (Zipf-popular). A
    share ``session_share`` of requests are turns of multi-turn sessions: a turn resends the whole
    history (previous prompts and answers) plus a few new blocks, so each turn's prefix is the last
    turn's prompt. The rest are one-off requests with fresh blocks after the system prompt. Which
    session continues is drawn with a bias to recent ones (users reply soon, or never).

    Args:
        n_requests: requests to generate.
        seed: RNG seed; equal arguments give equal traces.
        n_system_prompts: distinct shared system prompts.
        system_blocks: (min, max) blocks of a system prompt.
        zipf_alpha: popularity skew of the system prompts (> 1).
        session_share: share of requests that are session turns.
        new_session_prob: chance that a session turn starts a new session.
        turn_blocks: (min, max) new blocks per turn (user message, and the previous answer).
        oneoff_blocks: (min, max) blocks of a one-off request after its system prompt.
        max_session_blocks: a session ends when its history reaches this many blocks.

    Returns:
        The trace (block ids dense in order of first use).
    """
    if n_requests <= 0:
        raise InvalidInput(f"n_requests must be positive, got {n_requests}")
    if zipf_alpha <= 1:
        raise InvalidInput(f"zipf_alpha must be > 1, got {zipf_alpha}")
    rng = np.random.default_rng(seed)
    next_id = 0

    def fresh(k: int) -> list[int]:
        nonlocal next_id
        out = list(range(next_id, next_id + k))
        next_id += k
        return out

    systems = [fresh(int(rng.integers(system_blocks[0], system_blocks[1] + 1))) for _ in range(n_system_prompts)]
    weights = 1.0 / np.arange(1, n_system_prompts + 1) ** zipf_alpha
    weights /= weights.sum()
    sessions: list[list[int]] = []          # history (system prompt included), most recent last
    requests: list[list[int]] = []
    for _ in range(n_requests):
        system = systems[int(rng.choice(n_system_prompts, p=weights))]
        if rng.random() < session_share:
            if not sessions or rng.random() < new_session_prob:
                sessions.append(list(system))
                idx = len(sessions) - 1
            else:
                # Geometric pick from the most recent: recent sessions continue more often.
                idx = len(sessions) - 1 - min(int(rng.geometric(0.3)) - 1, len(sessions) - 1)
            history = sessions.pop(idx)
            history = history + fresh(int(rng.integers(turn_blocks[0], turn_blocks[1] + 1)))
            requests.append(history)
            if len(history) < max_session_blocks:
                sessions.append(history + fresh(int(rng.integers(turn_blocks[0], turn_blocks[1] + 1))))
        else:
            requests.append(list(system) + fresh(int(rng.integers(oneoff_blocks[0], oneoff_blocks[1] + 1))))
    return Trace.from_requests(requests, name=f"synthetic(n={n_requests}, seed={seed})")
