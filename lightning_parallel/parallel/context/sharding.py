"""Which tokens of the sequence a context rank holds: head-tail chunks for causal load balancing.

Note:
    Under a causal mask the last tokens of a sequence attend to everything and the first to
    almost nothing, so cutting the sequence into ``cp`` contiguous pieces gives the last rank
    most of the work. As Megatron-LM and torchtitan do, the sequence of length ``S`` is cut
    into ``2 * cp`` chunks of ``S / (2 * cp)`` tokens and context rank ``r`` holds chunks
    ``r`` and ``2 * cp - 1 - r`` (one from the head, one from the tail), concatenated in that
    order: every rank then has the same number of visible (query, key) pairs.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor


def check_sequence(seq_len: int, cp_size: int, setting: str = "context_parallel_size") -> None:
    """Raise unless a sequence of ``seq_len`` tokens can be cut into ``2 * cp_size`` equal chunks.

    Args:
        seq_len: the global sequence length (all context ranks together).
        cp_size: the number of context-parallel ranks.
        setting: the name of the user's setting for ``cp_size``, used in the message.

    Raises:
        ValueError: ``cp_size < 1``, or ``seq_len`` is not a positive multiple of ``2 * cp_size``.
    """
    if cp_size < 1:
        raise ValueError(f"{setting}={cp_size} must be >= 1.")
    unit = 2 * cp_size
    if seq_len < unit or seq_len % unit != 0:
        below = (seq_len // unit) * unit
        nearest = f"{below} or {below + unit}" if below > 0 else f"{unit}"
        raise ValueError(
            f"{setting}={cp_size} cuts each sequence into 2 x {cp_size} = {unit} equal chunks (head-tail load "
            f"balancing), but the sequence length is {seq_len}. Sequence lengths that work are multiples of {unit} "
            f"(nearest: {nearest}): pad or cut the sequences to one, or choose a {setting} for which "
            f"2 x {setting} divides {seq_len}."
        )


def _check_rank(cp_size: int, cp_rank: int) -> None:
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} must be in [0, {cp_size}) for a context group of {cp_size} ranks.")


def local_positions(
    seq_len: int, cp_size: int, cp_rank: int, device: Optional[Union[torch.device, str]] = None
) -> Tensor:
    """The global positions of context rank ``cp_rank``'s tokens, in its local order.

    Args:
        seq_len: the global sequence length ``S``.
        cp_size: the number of context-parallel ranks.
        cp_rank: this rank's index in the context group.
        device: where to build the tensor.

    Returns:
        An int64 tensor of ``S // cp_size`` positions: chunk ``cp_rank`` then chunk ``2 * cp_size - 1 - cp_rank``.
    """
    check_sequence(seq_len, cp_size)
    _check_rank(cp_size, cp_rank)
    chunk = seq_len // (2 * cp_size)
    tail = 2 * cp_size - 1 - cp_rank
    return torch.cat(
        [
            torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device),
            torch.arange(tail * chunk, (tail + 1) * chunk, device=device),
        ]
    )


def shard_sequence(tensor: Tensor, dim: int, cp_size: int, cp_rank: int) -> Tensor:
    """This context rank's share of ``tensor`` along the sequence dimension ``dim`` (a contiguous copy).

    Args:
        tensor: the tensor over the whole sequence.
        dim: its sequence dimension.
        cp_size: the number of context-parallel ranks.
        cp_rank: this rank's index in the context group.

    Returns:
        ``tensor`` restricted to ``local_positions(S, cp_size, cp_rank)`` along ``dim``, in that order.
    """
    check_sequence(tensor.size(dim), cp_size)
    _check_rank(cp_size, cp_rank)
    chunks = tensor.chunk(2 * cp_size, dim=dim)
    # cat always copies, so the share owns its memory and is contiguous.
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=dim)


def gather_sequence(local: Tensor, dim: int, group: Optional[dist.ProcessGroup]) -> Tensor:
    """Every context rank's share, all-gathered and put back in global order (the inverse of :func:`shard_sequence`).

    Forward only: no gradient flows back through the gather.

    Args:
        local: this rank's share, as :func:`shard_sequence` returned it.
        dim: the sequence dimension.
        group: the context-parallel process group.

    Returns:
        The tensor over the whole sequence, the same on every rank of ``group``.
    """
    cp_size = dist.get_world_size(group)
    if local.size(dim) % 2 != 0:
        raise ValueError(f"A context share is two equal chunks; its length {local.size(dim)} along dim {dim} is odd.")
    if cp_size == 1:
        return local.clone()
    local = local.detach().contiguous()
    shares = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(shares, local, group=group)
    heads = [share.chunk(2, dim=dim)[0] for share in shares]
    tails = [share.chunk(2, dim=dim)[1] for share in shares]
    # Rank r's tail is global chunk 2*cp-1-r: the tails in reverse rank order complete the sequence.
    return torch.cat(heads + tails[::-1], dim=dim)


def check_positions(positions: Tensor, cp_size: int, cp_rank: int) -> int:
    """Raise unless ``positions`` are this rank's head-tail positions; return the global sequence length.

    The attention functions derive every other rank's key positions from the layout, so
    queries at other positions would be matched against the wrong keys.

    Args:
        positions: int64 ``[s_local]``, what :func:`local_positions` gave this rank.
        cp_size: the number of context-parallel ranks.
        cp_rank: this rank's index in the context group.

    Returns:
        The global sequence length ``s_local * cp_size``.
    """
    if positions.dim() != 1:
        raise ValueError(f"positions must be 1D [s_local], got shape {tuple(positions.shape)}.")
    seq_len = positions.numel() * cp_size
    check_sequence(seq_len, cp_size)
    expected = local_positions(seq_len, cp_size, cp_rank, device=positions.device)
    # On meta (lp-simulate's step) positions carry no values to check; their shape was checked above.
    if positions.device.type != "meta" and not torch.equal(positions, expected):
        raise ValueError(
            f"positions are not context rank {cp_rank}'s head-tail positions of a {seq_len}-token sequence: "
            f"pass local_positions({seq_len}, {cp_size}, {cp_rank}) and shard the inputs with shard_sequence()."
        )
    return seq_len
