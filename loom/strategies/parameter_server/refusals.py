"""What parameter servers cannot train as one device does, refused at ``prepare`` in one line."""

from __future__ import annotations

from torch import nn

from loom.strategies.data_parallel.sync_batchnorm import first_batchnorm


def refuse_batchnorm(model: nn.Module) -> None:
    """Buffers stay on the workers: each would normalise its own batch and keep its own statistics."""
    if (name := first_batchnorm(model)) is not None:
        raise ValueError(
            f"ParameterServerStrategy cannot train BatchNorm layer '{name}' as one device does: each worker would "
            "normalise its own batch and keep running statistics that no server holds; use GroupNorm or LayerNorm "
            "there, or MirroredStrategy(sync_batchnorm=True)"
        )


def refuse_tied_tables(model: nn.Module, tables: dict[str, nn.Module]) -> None:
    """A table lives sharded on the servers; a dense layer sharing its weight would train a copy of its own."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for table, module in tables.items():
        others = [n for n in names.get(id(module.weight), []) if n != f"{table}.weight"]
        if others:
            raise ValueError(
                f"embedding '{table}' shares its weight with {others[0]}: the table lives sharded on the parameter "
                "servers, so the two would train as separate copies; untie them, or use MirroredStrategy"
            )
