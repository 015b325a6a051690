"""Whether the groups of a step have trained the same steps before it: a split quorum, found when its branches meet.

torchft's lighthouse forms a quorum of the groups that ask for one. A live group that did not ask
in time (its heartbeat late) can be left out, then form a quorum of its own while the others are
busy: both sides train the same global batch, each on its own, and when they meet again at the
same step neither heals. Each group therefore keeps a digest of the quorums of the steps it
applied (the same for every group of a quorum, and handed over with a heal); every step sums the
groups' digests, each in its own slot, with the gradients. Groups whose digest differs from that
of the lowest group of the step have trained another branch: the step is refused everywhere and
they leave, to be restarted and heal from the kept branch.
"""

from __future__ import annotations

import torch

_SPAN = 2**52  # digests are whole numbers a float64 holds exactly


class History:
    """A digest of the quorums (their ids) of the steps this group applied, one per step."""

    def __init__(self) -> None:
        self.value = 1

    def advance(self, quorum_id: int) -> None:
        self.value = hash((self.value, quorum_id)) % _SPAN or 1

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
