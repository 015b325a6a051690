"""Where each variable lives: dense parameters balanced by bytes, embedding tables split by rows.

A table's rows are cut into one contiguous range per server, so a table larger than one
server's memory still fits, and a worker asks each server only for the rows its batch
touches. Dense parameters then go, largest first, to the server holding the fewest bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class Placement:
    num_servers: int
    dense: dict[str, int]  # parameter name -> server
    row_bounds: dict[str, list[int]]  # table name -> first row of each server's range, then the row count

    def server_bytes(self, dense_bytes: dict[str, int], table_row_bytes: dict[str, int]) -> list[int]:
        """Bytes each server holds under this placement."""
        load = [0] * self.num_servers
        for name, server in self.dense.items():
            load[server] += dense_bytes[name]
        for name, bounds in self.row_bounds.items():
            for server in range(self.num_servers):
                load[server] += (bounds[server + 1] - bounds[server]) * table_row_bytes[name]
        return load

    @cached_property
    def _bounds(self) -> dict[str, torch.Tensor]:
        return {name: torch.tensor(bounds) for name, bounds in self.row_bounds.items()}

    def rows_by_server(self, table: str, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """For each server: the positions in ``ids`` it holds, and those ids local to its range."""
        bounds = self._bounds[table]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= bounds[-1]):
            raise IndexError(f"embedding '{table}' has {int(bounds[-1])} rows; got ids from {int(ids.min())} to {int(ids.max())}")
        owner = torch.bucketize(ids, bounds[1:-1], right=True)
        out = []
        for server in range(self.num_servers):
            positions = (owner == server).nonzero(as_tuple=True)[0]
            out.append((positions, ids[positions] - bounds[server]))
        return out


def row_bounds(rows: int, num_servers: int) -> list[int]:
    """Contiguous ranges whose sizes differ by at most one row."""
    base, extra = divmod(rows, num_servers)
    bounds = [0]
    for server in range(num_servers):
        bounds.append(bounds[-1] + base + (1 if server < extra else 0))
    return bounds


def place(dense_bytes: dict[str, int], tables: dict[str, tuple[int, int]], num_servers: int) -> Placement:
    """``tables`` maps a name to (rows, bytes per row)."""
    if num_servers < 1:
        raise ValueError(f"a parameter-server job needs at least one server, got {num_servers}")
    bounds = {name: row_bounds(rows, num_servers) for name, (rows, _) in tables.items()}
    load = Placement(num_servers, {}, bounds).server_bytes({}, {name: row_size for name, (_, row_size) in tables.items()})
    dense = {}
    for name, size in sorted(dense_bytes.items(), key=lambda item: (-item[1], item[0])):
        server = min(range(num_servers), key=lambda s: (load[s], s))
        dense[name] = server
        load[server] += size
    return Placement(num_servers, dense, bounds)
