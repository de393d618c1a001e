"""Serving across ranks (`--parallel`, docs/distributed.md): rank 0's worker sends every job to the other ranks
(the followers), which run the same engine calls on their share of the model, so their collectives line up.

Rank 0 broadcasts one message per job (a `Work`: prompt ids, limits, sampling with its seed fixed, logit
adjustments, stop ids, the grammar's text), then one flag per generated token (go on, or stop: a stop token,
a cancelled request, a client gone); while idle, a heartbeat every quarter of $DS4_DIST_TIMEOUT, so a
follower learns within that timeout that rank 0 is gone; at shutdown, `Shutdown`. Everything else a job does
(prefix reuse, truncation, snapshots and restores of the session, speculation, grammar rollbacks) follows
from the same inputs on every rank.
"""
from __future__ import annotations

import random
import threading
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ds4 import distributed
from ds4.sampling import LogitAdjustments, SamplingParams


@dataclass(frozen=True)
class Work:
    """One job as the followers repeat it."""

    ids: list[int]
    max_tokens: int
    sampling: SamplingParams            # its seed fixed by rank 0 when the request sampled without one
    adjust: LogitAdjustments
    stop_ids: frozenset[int]
    grammar: str | None                 # the constraint's grammar text (followers build their own parser)
    constrain_after: int | None
    fresh_session: bool                 # rank 0 starts from a new session (its last one ended in an error)


@dataclass(frozen=True)
class Heartbeat:
    """Rank 0 is alive and idle."""


@dataclass(frozen=True)
class Shutdown:
    """Rank 0 is stopping: followers leave their loop."""


Message = Work | Heartbeat | Shutdown


def seeded(sampling: SamplingParams) -> SamplingParams:
    """`sampling` with a seed every rank can share (a sampled request without one gets a random one)."""
    if sampling.temperature > 0 and sampling.seed is None:
        return replace(sampling, seed=random.getrandbits(62))
    return sampling


class Link:
    """This rank's end of the messages from rank 0 (every call is a collective: every rank makes it in turn)."""

    def __init__(self, world: distributed.World):
        self.world = world
        self.idle_s = world.timeout_s / 4   # rank 0 sends a heartbeat this often while no job runs
        self.lock = threading.Lock()        # rank 0's worker thread and its closing thread take turns

    def send(self, message: Message) -> None:
        """Rank 0: broadcast a message."""
        self._broadcast(message)

    def receive(self) -> Message:
        """A follower: the next message from rank 0 (ParallelError when rank 0 is gone past the timeout)."""
        return self._broadcast(None)

    def agree(self, token: int, go: bool = False) -> bool:
        """After each generated token: rank 0 sends whether the generation goes on (`go`), every rank returns
        it. With $DS4_DIST_CHECK=1 every rank's token is compared first."""
        with self.lock, distributed.collective_errors(self.world):
            if self.world.check_tokens:
                distributed.check_same(self.world, token, "a served token")
            flag = torch.tensor([int(go)])
            dist.broadcast(flag, src=0)
        return bool(flag.item())

    def _broadcast(self, message: Message | None) -> Message:
        box = [message]
        with self.lock, distributed.collective_errors(self.world):
            dist.broadcast_object_list(box, src=0)
        return box[0]
