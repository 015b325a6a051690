"""What each parameter-server request must hold, checked before the server acts on it.

A request's fields are JSON from the network: each operation names its fields and their
types here, and the tensors it may carry, so that a malformed request (from a buggy worker
or a process that holds the token) is refused with one line naming what is wrong, before
any of the server's state is touched.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from loom.strategies.parameter_server.wire import WireError

MAX_COUNT = 65_536  # workers in a job, as a request may state it: the server keeps an entry for each
MAX_WAIT = 10.0  # seconds a request may ask the server to wait for a round or a collective


def integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def number(value: Any) -> bool:
    return (integer(value) or isinstance(value, float)) and math.isfinite(value)


def wait(value: Any) -> bool:
    return number(value) and 0 <= value <= MAX_WAIT


def count(value: Any) -> bool:
    return integer(value) and 0 <= value <= MAX_COUNT


def text(value: Any) -> bool:
    return isinstance(value, str)


def texts(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def integers(value: Any) -> bool:
    return isinstance(value, list) and all(integer(v) for v in value)


def index(value: Any) -> bool:
    """A worker's number in the job (its name, ``worker``, is text)."""
    return integer(value) and 0 <= value < MAX_COUNT


def positive(value: Any) -> bool:
    return number(value) and value > 0


def hyper_value(value: Any) -> bool:
    return value is None or isinstance(value, (bool, str)) or number(value) or (isinstance(value, list) and all(number(v) for v in value))


def groups(value: Any) -> bool:
    """Parameter groups' hyper-parameters: a list of {name: number, flag, or list of numbers}."""
    return isinstance(value, list) and all(isinstance(g, dict) and all(text(k) and hyper_value(v) for k, v in g.items()) for g in value)


def optimizer(value: Any) -> bool:
    """``ServerOptimizer``'s fields, as ``dataclasses.asdict`` gives them."""
    if not isinstance(value, dict) or not set(value) <= {"kind", "groups", "assign", "lazy_rows"}:
        return False
    assign = value.get("assign", {})
    return (
        text(value.get("kind", "SGD")) and groups(value.get("groups", [{}])) and len(value.get("groups", [{}])) >= 1
        and isinstance(assign, dict) and all(integer(v) and 0 <= v < len(value.get("groups", [{}])) for v in assign.values())
        and isinstance(value.get("lazy_rows", False), bool)
    )  # fmt: skip


def draws(value: Any) -> bool:
    """Tables a server draws itself: {name: {rows, dim, seed, padding_row?}}."""
    if not isinstance(value, dict):
        return False
    for spec in value.values():
        if not isinstance(spec, dict) or not set(spec) <= {"rows", "dim", "seed", "padding_row"}:
            return False
        if not (all(integer(spec.get(k)) and spec[k] >= 0 for k in ("rows", "dim", "seed"))):
            return False
        if spec.get("padding_row") is not None and not (integer(spec["padding_row"]) and 0 <= spec["padding_row"] < spec["rows"]):
            return False
    return True


def numbers(value: Any) -> bool:
    return isinstance(value, dict) and all(number(v) for v in value.values())


def anything(value: Any) -> bool:
    return True


Check = Callable[[Any], bool]
SEEN = {"seen": integer}  # any request: the newest version the worker has seen
# op -> (required fields, optional fields, tensor names it may carry: "kind/" takes any "kind/<name>", else that name only)
REQUESTS: dict[str, tuple[dict[str, Check], dict[str, Check], frozenset[str]]] = {
    "create": ({"optimizer": optimizer}, {"generate": draws}, frozenset({"dense/", "table/"})),
    "ready": ({}, {}, frozenset()),
    "pull": ({"names": texts}, {}, frozenset({"ids/"})),
    "pull_rows": ({"table": text}, {}, frozenset({"ids"})),
    "push": (
        {"worker": text, "seq": integer},
        {"index": index, "sync": lambda v: v is None or (count(v) and v > 0), "hyper": lambda v: v is None or groups(v),
         "based_on": lambda v: v is None or integer(v), "parts": integers, "closure": text},
        frozenset({"grad/", "rowids/", "rowgrad/"}),
    ),  # fmt: skip
    "commit": ({"worker": text, "seq": integer}, {"names": texts}, frozenset({"ids/"})),
    "abort": ({"worker": text, "seq": integer}, {}, frozenset()),
    "pending": ({"worker": text}, {}, frozenset()),
    "round": ({"round": integer}, {"wait": wait}, frozenset()),
    "tick": ({"worker": index, "clock": integer, "workers": count, "lease": positive}, {}, frozenset()),
    "finish": ({"worker": index, "code": integer}, {}, frozenset()),
    "meet": ({"worker": index}, {"next": anything, "number": integer, "workers": count, "reduce": text, "wait": wait},
             frozenset({"value"})),  # fmt: skip
    "read": ({"name": text, "start": lambda v: integer(v) and v >= 0, "budget": integer}, {}, frozenset()),
    "write": ({"name": text, "start": lambda v: integer(v) and v >= 0}, {"slots": numbers}, frozenset({"value", "whole/", "slot/"})),
    "lineage": ({}, {"add": lambda v: v is None or text(v)}, frozenset()),
    "stats": ({}, {}, frozenset()),
    "closures": ({"closure": lambda v: integer(v) and v >= 0}, {}, frozenset()),
    "schedule": (
        {"do": lambda v: v in ("add", "take", "done", "status", "beat")},
        {"first": lambda v: integer(v) and v >= 0, "names": texts, "worker": index, "pid": integer, "below": lambda v: integer(v) and v >= 0,
         "want": integers, "wait": wait, "number": lambda v: integer(v) and v >= 0, "result": anything, "error": lambda v: v is None or text(v)},
        frozenset({"r/"}),
    ),  # fmt: skip
    "fail": ({"reason": text}, {}, frozenset()),
}
MEET_GIVING = ("number", "workers", "reduce")  # a "meet" that is not asking for "next" gives a value to one collective


def check(fields: Any, tensors: dict[str, torch.Tensor]) -> str:
    """The request's operation, once its fields and tensors are what that operation takes; else ``WireError``."""
    if not isinstance(fields, dict):
        raise WireError(f"the fields must be a JSON object, not {type(fields).__name__}")
    op = fields.get("op")
    if not isinstance(op, str) or op not in REQUESTS:
        raise WireError(f"unknown operation {op!r}; one of: {', '.join(REQUESTS)}")
    required, optional, kinds = REQUESTS[op]
    for name in required:
        if name not in fields:
            raise WireError(f"{op}: field '{name}' is missing")
    if op == "meet" and not fields.get("next"):
        for name in MEET_GIVING:
            if name not in fields:
                raise WireError(f"meet: field '{name}' is missing")
    allowed = {**required, **optional, **SEEN}
    for name, value in fields.items():
        if name != "op" and (name not in allowed or not allowed[name](value)):
            raise WireError(f"{op}: field '{name}' is not what {op} takes: {_short(value)}")
    for key, tensor in tensors.items():
        if not any(key.startswith(k) and len(key) > len(k) if k.endswith("/") else key == k for k in kinds):
            raise WireError(f"{op}: unexpected tensor '{key}'")
        kind = key.partition("/")[0]
        if kind in ("ids", "rowids") and (tensor.dtype not in (torch.int64, torch.int32) or tensor.dim() != 1):
            raise WireError(f"{op}: '{key}' must be a 1-d integer tensor of row ids, not {tensor.dtype} {list(tensor.shape)}")
        if kind in ("grad", "rowgrad", "dense", "table") and not tensor.is_floating_point():
            raise WireError(f"{op}: '{key}' must be a floating-point tensor, not {tensor.dtype}")
    return op


def _short(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 60 else f"{shown[:57]}..."
