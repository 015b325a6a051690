"""Whether the groups of a step have trained the same steps before it: a split quorum, found when its branches meet.

torchft's lighthouse forms a quorum of the groups that ask for one. A live group that did not ask
in time (its heartbeat late) can be left out, then form a quorum of its own while the others are
busy: both sides train the same global batch, each on its own, and when they meet again at the
same step neither heals. Each group therefore keeps a digest of the quorums of the steps it
applied (the same for every group of a quorum, and handed over with a heal); every step sums the
groups' digests, each in its own slot, with the gradients. Groups whose digest differs from that
of the lowest group of the step have trained another branch: the step is refused everywhere and
they leave, to be restarted and heal from the kept branch.

Branches that meet at different steps never share a step: torchft heals the one behind from the
one ahead. The digest of each recent step goes with the heal, so the group that heals can tell
whether it was behind on the same branch (nothing lost) or drops steps of its own (``take``).
"""

from __future__ import annotations

from typing import Any

import torch

_SPAN = 2**52  # digests are whole numbers a float64 holds exactly
_RESUMED = -1  # marks a resume in the digest (quorum ids are never negative)
KEPT = 1024  # recent steps whose digests are kept (and handed over with a heal): a longer branch cannot be told


class History:
    """A digest of the quorums (their ids) of the steps this group applied, one per step, and the
    digests after each of its last ``KEPT`` steps."""

    def __init__(self) -> None:
        self.value, self.steps = 1, 0
        self.recent = {0: 1}

    def advance(self, quorum_id: int) -> None:
        self.value = hash((self.value, quorum_id)) % _SPAN or 1
        self.steps += 1
        self.recent[self.steps] = self.value
        self.recent.pop(self.steps - KEPT, None)

    def resume(self, batches: int) -> None:
        """The job resumed from a checkpoint of ``batches`` global batches: a branch of its own, unless every group did the same."""
        self.value = hash((self.value, _RESUMED, batches)) % _SPAN or 1  # ints only: a str's hash differs from process to process
        self.recent[self.steps] = self.value

    def state(self) -> dict[str, Any]:
        return {"value": self.value, "steps": self.steps, "recent": dict(self.recent)}

    def take(self, live: dict[str, Any]) -> int | None:
        """Take a live group's history with its heal. Returns how many of this group's own last steps
        the live group never applied (a branch of a split quorum that this heal drops): 0 when this
        group was behind on the live group's branch, None when its branch is older than the digests
        kept."""
        theirs, own = live["recent"], self.steps
        shared = (k for k in range(own, own - KEPT, -1) if k in self.recent and theirs.get(k) == self.recent[k])
        common = 0 if own == 0 else next(shared, None)  # a group that applied no step (restarted) has none to drop
        self.value, self.steps, self.recent = live["value"], live["steps"], dict(theirs)
        return None if common is None else own - common

    def slots(self, group: int, groups: int, healing: bool = False) -> torch.Tensor:
        """This group's digest in its slot of ``groups`` (zeros while healing: it has no branch yet)."""
        slots = torch.zeros(groups, dtype=torch.float64)
        if not healing:
            slots[group] = self.value
        return slots

    @staticmethod
    def diverged(summed: torch.Tensor) -> list[int]:
        """The groups whose digest differs from the lowest group's, in slots summed over a step's groups."""
        present = [(g, int(v)) for g, v in enumerate(summed.tolist()) if v]
        return [g for g, v in present if v != present[0][1]] if present else []
