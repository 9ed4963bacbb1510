"""The numbers a training step sums over the world in its one all-reduce and reads on the host in its one transfer,
by name: the loss, the world's stop requests, each MTP depth's loss, the objective's sums (DPO's metrics) and every
rank's step time. Their layout in the vector lives here and nowhere else: a feature that reports a sum (an indexer
loss, an adapter's statistic) adds a part, and `host`/`fill`/`split`/`unpack` place it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer3d.distributed.collectives import host_values


@dataclass(frozen=True)
class StepScalars:
    """The vector's parts' widths: `depths` MTP losses, `objective` sums, `ranks` step times (0 in evaluation)."""

    depths: int = 0
    objective: int = 0
    ranks: int = 0

    LOSS, STOP = 0, 1  # then the depths, the objective's sums, the ranks' times

    @property
    def _depths(self) -> slice:
        return slice(2, 2 + self.depths)

    @property
    def _objective(self) -> slice:
        return slice(2 + self.depths, 2 + self.depths + self.objective)

    @property
    def _ranks(self) -> slice:
        return slice(2 + self.depths + self.objective, 2 + self.depths + self.objective + self.ranks)

    def host(self, device: torch.device, stop_requested: bool, rank: int | None = None,
             seconds: float = 0.0) -> torch.Tensor:
        """The vector on `device`, with what the host knows (this rank's stop request and step time) in place: one
        queued copy."""
        values = [0.0] * (2 + self.depths + self.objective + self.ranks)
        values[self.STOP] = float(stop_requested)
        if self.ranks:
            values[self._ranks.start + rank] = seconds
        return host_values(values, device)

    def fill(self, local: torch.Tensor, loss: torch.Tensor, depths: torch.Tensor | None = None,
             objective: torch.Tensor | None = None) -> None:
        """This rank's device-side shares (the last stage's tp rank 0 only): the loss, the depths', the objective's."""
        local[self.LOSS] = loss
        if self.depths:
            local[self._depths] = depths
        if self.objective:
            local[self._objective] = objective

    def split(self, total: torch.Tensor, dp_cp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The world's sums -> (the mean loss, the stop requests, the rest as the engine's `extra`: each depth's mean
        loss, the objective's sums, the ranks' times), device tensors the engine reads in its one transfer."""
        total = total.double()
        total[self._depths] /= dp_cp  # each depth's mean loss L_k
        return total[self.LOSS] / dp_cp, total[self.STOP], total[2:]

    def unpack(self, extra: list[float]) -> tuple[list[float], list[float], list[float]]:
        """The engine's read of `extra` -> (the depths' losses, the objective's sums, the ranks' times)."""
        shift = lambda s: slice(s.start - 2, s.stop - 2)  # noqa: E731 - extra starts after the loss and stop
        return extra[shift(self._depths)], extra[shift(self._objective)], extra[shift(self._ranks)]
