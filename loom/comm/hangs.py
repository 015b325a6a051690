"""Name why a job hangs, from every rank's record of its collectives.

Every rank must issue the same collectives in the same order; a hang is where they stop
agreeing. The records say where: the first collective number at which ranks issued different
ops or from different lines, the rank that never reached the collective the others wait in
(with its Python stack), and the usual cause, a collective that only some ranks run
(evaluation or logging under ``if is_chief:``), found in the records or in the code around
the call.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import Any

from loom.comm.stacks import call_name, describe
from loom.errors import LoomError

Record = dict[str, Any]
Call = dict[str, Any]
P2P = ("send", "recv")  # one rank sends while another receives: they differ by design

# Names in an `if` test that make it true on some ranks only.
_RANKISH = re.compile(r"rank|chief|is_main|main_process|is_master|master_process|global_zero", re.IGNORECASE)
_SOME_RANKS = (
    "every rank must run the same collectives in the same order (code under `if is_chief:`, "
    "such as evaluation or logging, is the usual cause): run it on every rank, or move the collective out of it"
)


class HangError(LoomError):
    """The job's collectives stopped matching across ranks; the message says where each rank is."""


def _site(call: Call) -> str:
    f = call["frames"][0] if call["frames"] else None
    return f"{Path(f['file']).name}:{f['line']}" if f else "?"


def _place(call: Call) -> str:
    """The user's line a call was made from, or waits at (an unstamped call, like FSDP's, has only the latter)."""
    f = (call["frames"] or call.get("where") or [None])[0]
    return f"{Path(f['file']).name}:{f['line']}" if f else "?"


def _signature(call: Call) -> tuple:
    return call["op"], _site(call), str(call["shapes"]), str(call["dtypes"])


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _by_seq(records: dict[int, Record], group: str) -> dict[int, dict[int, Call]]:
    """Each member's calls in ``group`` by number (a member is a rank that made one there)."""
    calls = {r: {c["seq"]: c for c in rec["calls"] if c["group"] == group} for r, rec in records.items()}
    return {r: per_rank for r, per_rank in calls.items() if per_rank}


def _first_divergence(calls: dict[int, dict[int, Call]]) -> int | None:
    for seq in sorted({s for per_rank in calls.values() for s in per_rank}):
        present = [per_rank[seq] for per_rank in calls.values() if seq in per_rank]
        if len(present) > 1 and len({_signature(c) for c in present}) > 1:
            return seq
    return None


def _divergence(calls: dict[int, dict[int, Call]], seq: int) -> str:
    """``rank 1 is in barrier #5 (t.py:19) while rank 0 is in all_reduce #5 (t.py:17)``: the odd ranks first."""
    groups: dict[tuple, list[int]] = {}
    for r in sorted(calls):
        if seq in calls[r]:
            groups.setdefault(_signature(calls[r][seq]), []).append(r)
    same_place = len({sig[:2] for sig in groups}) == 1  # then shapes or dtypes differ: show them
    parts = []
    lowest = min(r for ranks in groups.values() for r in ranks)  # in a tie, its side is the reference
    for sig, ranks in sorted(groups.items(), key=lambda item: (len(item[1]), lowest in item[1])):
        call = calls[ranks[0]][seq]
        verb = ("is in" if len(ranks) == 1 else "are in") if not call["done"] else "ran"
        shape = f" of {sig[3]} {sig[2]}" if same_place else ""
        parts.append(f"{_ranks(ranks)} {verb} {call_name(call)}{shape}")
    return parts[0] + " while " + ", ".join(parts[1:])


def _positions(records: dict[int, Record], calls: dict[int, dict[int, Call]], diverged: bool = False) -> list[str]:
    """Ranks behind the furthest collective in flight, each with where it is instead (``it finished
    its program`` for one that never will)."""
    pending = {r: max((s for s, c in per_rank.items() if not c["done"]), default=None) for r, per_rank in calls.items()}
    waited = [s for s in pending.values() if s is not None]
    if not waited:
        return []
    furthest = max(waited)
    target = next(calls[r][furthest] for r in calls if pending[r] == furthest)
    behind = [r for r, per_rank in calls.items() if pending[r] != furthest and max(per_rank, default=0) < furthest]
    if not behind:
        if diverged or any(pending[r] != furthest for r in calls):  # the divergence says why
            return []
        return [f"all ranks are in {call_name(target)} and none returned: a link between them is down or too slow for the timeout"]
    clauses = []
    for r in behind:
        record = records[r]
        how = "it finished its program" if record["finished"] else f"its Python stack: {describe(record['stack'])}"
        clauses.append(f"rank {r} never reached {call_name(target)}; {how}")
    return clauses


@functools.lru_cache(maxsize=32)
def _tree(path: str) -> tuple[ast.Module, str] | None:
    try:
        source = Path(path).read_text()
        return ast.parse(source), source
    except (OSError, SyntaxError, ValueError):
        return None


def rank_condition(path: str, line: int) -> tuple[str, int] | None:
    """The innermost ``if`` around ``line`` whose test depends on the rank: (its text, its line)."""
    parsed = _tree(path)
    if parsed is None:
        return None
    tree, source = parsed
    found = None
    for node in ast.walk(tree):
        if not isinstance(node, ast.If) or not (node.lineno < line <= (node.end_lineno or 0)):
            continue
        test = ast.get_source_segment(source, node.test) or ""
        if _RANKISH.search(test) and (found is None or node.lineno > found[1]):
            in_else = not any(b.lineno <= line <= (b.end_lineno or b.lineno) for b in node.body)
            found = (f"else: of `if {test}:`" if in_else else f"`if {test}:`", node.lineno)
    return found


def _conditional(call: Call) -> str | None:
    """The rank-dependent ``if`` around ``call``, and why that parts the ranks (a pipeline's call says why itself)."""
    why = call.get("hint") or _SOME_RANKS
    for frame in call["frames"] or call.get("where") or []:
        found = rank_condition(frame["file"], frame["line"])
        if found is not None:
            return f"{call['op']} at {_place(call)} runs under {found[0]} ({Path(frame['file']).name}:{found[1]}), on some ranks only: {why}"
    return None


def _ran_on_some_only(calls: dict[int, dict[int, Call]]) -> list[str]:
    """Lines whose collectives completed on some ranks while the others went past them without."""
    first: dict[str, tuple[int, set[int], Call]] = {}
    for r, per_rank in calls.items():
        for seq, c in sorted(per_rank.items()):
            if c["done"]:
                seen = first.setdefault(_site(c), (seq, set(), c))
                first[_site(c)] = (min(seen[0], seq), seen[1] | {r}, c)
    done_up_to = {r: max((s for s, c in per_rank.items() if c["done"]), default=0) for r, per_rank in calls.items()}
    sites_of = {r: {_site(c) for c in per_rank.values()} for r, per_rank in calls.items()}
    found = []
    for site, (seq, ranks, call) in first.items():
        skipped = [r for r in calls if r not in ranks and site not in sites_of[r] and done_up_to[r] >= seq]
        if skipped:
            found.append(f"{call['op']} at {site} ran on {_ranks(sorted(ranks))} only, never on {_ranks(skipped)}: {_SOME_RANKS}")
    return found


def aborted(position: dict[str, Any]) -> tuple[str, str]:
    """For a rank ended in a collective (``stacks.aborted_in``): ``reduce (train.py:24)``, and why
    that is the usual cause (the rank-dependent ``if`` around it, when the code shows one)."""
    call = {"group": "0", "seq": 0, "op": position["op"], "frames": position["frames"], "done": False}
    mismatch = "the ranks' collectives did not match (gloo aborts a rank that receives more than its collective expects)"
    return f"{position['op']} ({_place(call)})", f"{mismatch}; {_conditional(call) or _SOME_RANKS}"


def explain(records: dict[int, Record], world_size: int, certain: bool = False) -> str | None:
    """One paragraph naming where the ranks' collectives part, or None when the records agree and none waits.

    ``certain``: only a finding that no wait can undo (ranks in different collectives, a
    collective run on some ranks only, a rank that finished while others wait for it), not a
    rank that is merely behind.
    """
    if certain:  # only collectives: their numbers and sites must agree on every rank
        records = {r: {**rec, "calls": [c for c in rec["calls"] if c["op"] not in P2P]} for r, rec in records.items()}
    clauses: list[str] = []
    causes: list[str] = []
    hints: list[str] = []
    final = False
    groups = sorted({c["group"] for rec in records.values() for c in rec["calls"]})
    for group in groups:
        calls = _by_seq(records, group)
        seq = _first_divergence(calls)
        involved: list[Call] = []
        if seq is not None:
            current = all(not per_rank[seq]["done"] for per_rank in calls.values() if seq in per_rank)
            text = _divergence(calls, seq)
            clauses.append(f"collectives out of step at #{seq}: {text}" if current else f"the ranks' collectives first differed at #{seq}: {text}")
            involved = [per_rank[seq] for per_rank in calls.values() if seq in per_rank]
            hints += [f"{c['op']} at {_place(c)}: {c['hint']}" for c in involved if c.get("hint")]
            final = True
        if seq is None or not current:
            positions = _positions(records, calls, diverged=seq is not None)
            final = final or any(p.endswith("it finished its program") for p in positions)
            clauses += positions
            involved += [c for per_rank in calls.values() for c in per_rank.values() if not c["done"]]
        skipped = _ran_on_some_only(calls)
        final = final or bool(skipped)
        for call in involved:  # the `if` around a call says more than the lines it ran on: first
            cause = _conditional(call)
            if cause and cause not in causes:
                causes.append(cause)
        causes += skipped
    if certain and not final:
        return None
    causes += hints  # the calls that parted say what they need, where no `if` was found around them
    silent = sorted(set(range(world_size)) - set(records))
    if silent and clauses:
        clauses.append(f"{_ranks(silent)} did not answer")
    return "; ".join(clauses + causes[:1]) or None
