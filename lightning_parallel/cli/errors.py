"""What the console shows of an error: its root cause, short, once per run.

An error raised through Hydra's ``instantiate`` reads "Error in call to target '...HFCausalLM':" on its first
line; the suite's own message with the remedy is its cause. :func:`root_cause` walks the chain of causes to the
innermost one a user can act on, and :func:`short_message` keeps long lists (a ``state_dict`` mismatch of 37
tensors) readable: the first few entries of each kind, then how many more. The full traceback stays in the
run's log file (:func:`lightning_parallel.cli.run_start.log_traceback`).

Child ranks started by :mod:`lightning_parallel.cli.launch` write their line to :func:`rank_error_file` instead of
the console; the launcher prints it once (a rank that fails alone), or rank 0 prints its own (all failed alike).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

# Wrappers whose own message only says where the error passed through, not what it is.
_WRAPPER_PREFIXES = ("Error in call to target", "Error locating target", "Error instantiating")
# torch's load_state_dict lists: 'Missing key(s) in state_dict: "a", "b".' and one 'size mismatch for ...' per tensor.
_KEY_LIST = re.compile(r'^(\s*(?:Missing|Unexpected) key\(s\) in state_dict: )(.*?)\.?\s*$')
_QUOTED = re.compile(r'"[^"]*"')
MAX_ITEMS = 4  # entries shown of each list (the rest counted)
MAX_LINES = 8  # lines of one message on the console
# What a rank sees when another rank died: the consequence, not the cause (gloo, NCCL, a closed store).
_PEER_GONE = re.compile(r"gloo|nccl|Connection (closed|reset)|remote worker|Broken pipe|DistBackendError|"
                        r"DistNetworkError|TCPStore|ProcessGroup", re.I)


def _next_cause(error: BaseException) -> Optional[BaseException]:
    if error.__cause__ is not None:
        return error.__cause__
    return None if error.__suppress_context__ else error.__context__


def _is_wrapper(error: BaseException) -> bool:
    text = str(error).strip()
    return type(error).__name__ == "InstantiationException" or text.startswith(_WRAPPER_PREFIXES) or not text


def root_cause(error: BaseException) -> BaseException:
    """The innermost error of ``error``'s chain that says what went wrong (not a wrapper such as Hydra's
    "Error in call to target").

    Args:
        error: the error as it reached the entry point.
    """
    chain, seen = [error], {id(error)}
    while (cause := _next_cause(chain[-1])) is not None and id(cause) not in seen:
        chain.append(cause)
        seen.add(id(cause))
    # The outermost error that is not a wrapper: the suite's own messages wrap torch's with the remedy added.
    return next((e for e in chain if not _is_wrapper(e)), chain[-1])


def _shorten_key_list(line: str) -> str:
    match = _KEY_LIST.match(line)
    if not match:
        return line
    keys = _QUOTED.findall(match.group(2))
    if len(keys) <= MAX_ITEMS:
        return line
    return f"{match.group(1)}{', '.join(keys[:MAX_ITEMS])} and {len(keys) - MAX_ITEMS} more"


def short_message(error: BaseException) -> str:
    """``error``'s message for the console: long key lists cut to :data:`MAX_ITEMS` entries, runs of
    ``size mismatch for ...`` lines to :data:`MAX_ITEMS` with a count, at most :data:`MAX_LINES` lines.

    Args:
        error: the error to show (usually :func:`root_cause` of what was raised).
    """
    lines = [_shorten_key_list(line.rstrip()) for line in str(error).strip().splitlines() if line.strip()]
    lines = lines or [type(error).__name__]
    out: list[str] = []
    mismatches = 0
    for line in lines:
        if line.strip().startswith("size mismatch for"):
            mismatches += 1
            if mismatches > MAX_ITEMS:
                continue
        out.append(line)
    if mismatches > MAX_ITEMS:
        out.append(f"\t... and {mismatches - MAX_ITEMS} more size mismatches")
    if len(out) > MAX_LINES:
        out = [*out[:MAX_LINES], f"... ({len(out) - MAX_LINES} more lines in the log)"]
    return "\n".join(out)


def error_line(error: BaseException) -> str:
    """``<Type>: <message>`` of ``error``'s root cause, shortened (what ``lp-train: error:`` is followed by).

    Args:
        error: the error as it reached the entry point.
    """
    cause = root_cause(error)
    return f"{type(cause).__name__}: {short_message(cause)}"


def rank_error_file(run_dir: Path, rank: int) -> Path:
    """Where a child rank leaves its error line for the launcher (``.lp/error-rank<k>.txt`` in the run folder).

    Args:
        run_dir: the run folder.
        rank: the child's global rank.
    """
    return run_dir / ".lp" / f"error-rank{rank}.txt"


def read_rank_error(run_dir: Path, rank: int) -> Optional[str]:
    """The error line a child rank left (None: it left none).

    Args:
        run_dir: the run folder.
        rank: the child's global rank.
    """
    try:
        return rank_error_file(run_dir, rank).read_text().strip() or None
    except OSError:
        return None


def is_peer_gone(error: BaseException) -> bool:
    """True when ``error`` is what a rank sees after another rank died (gloo, NCCL, the store): a consequence.

    Args:
        error: a rank's error.
    """
    cause = root_cause(error)
    return bool(_PEER_GONE.search(f"{type(cause).__name__} {cause}"))


class RankError(RuntimeError):
    """Another rank's error, shown instead of rank 0's own when rank 0 only saw that rank leave.

    Args:
        rank: the global rank that failed first.
        line: the error line it left (:func:`rank_error_file`).
    """

    def __init__(self, rank: int, line: str) -> None:
        super().__init__(line)
        self.rank = rank
        self.line = line


def earlier_rank_error(run_dir: Path, ranks: Iterable[int], failed_at: float,
                       error: BaseException) -> Optional[RankError]:
    """The error of a child rank that failed before rank 0 did, or whose leaving rank 0's error reports (None:
    rank 0's own error is the cause).

    Args:
        run_dir: the run folder.
        ranks: the child ranks.
        failed_at: when rank 0's error reached the launcher (``time.time()``).
        error: rank 0's error.
    """
    peer_gone = is_peer_gone(error)
    found = []
    for rank in ranks:
        line = read_rank_error(run_dir, rank)
        if line is not None and (peer_gone or rank_error_file(run_dir, rank).stat().st_mtime <= failed_at):
            found.append(RankError(rank, line))
    # A rank with a cause of its own before one that also only saw a peer leave.
    found.sort(key=lambda e: bool(_PEER_GONE.search(e.line.split("\n", 1)[0])))
    return found[0] if found else None
