"""Which keys a query may see, decided from global positions so no rank builds the ``S x S`` mask.

Note:
    Under context parallelism a rank holds ``S / cp`` queries and meets the keys one block at
    a time, so the mask is a rule, not a tensor: :meth:`AttentionMask.block` builds the
    ``[s_q, s_k]`` piece for the global positions of a block's queries and keys. The rules
    are Hugging Face's (``transformers.masking_utils``), so a model keeps its attention
    pattern when its sequence is split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass(frozen=True, eq=False)  # eq=False: a dataclass __eq__ would compare the documents tensor elementwise
class AttentionMask:
    """Visibility rule of one attention layer over the global sequence.

    A query at global position ``q`` may see the key at ``k`` when all of these hold:

    * ``causal``: ``k <= q``;
    * ``window`` with ``causal``: ``q - k < window`` (Hugging Face's ``sliding_window_overlay``,
      ``kv_idx > q_idx - sliding_window``: the query and the ``window - 1`` keys before it);
    * ``window`` without ``causal``: ``|q - k| <= window`` (Hugging Face's
      ``sliding_window_bidirectional_overlay``, inclusive);
    * ``documents``: ``documents[b, k] == documents[b, q]`` and ``documents[b, k] >= 0``. A
      padding position (id ``-1``) is never a visible key, and a padding query sees no key:
      its output is 0, as flash attention gives a row with no visible key.

    Within one packed document, positions and document-relative positions differ by a
    constant, so the causal and window rules above equal Hugging Face's, which it applies to
    the remapped ``position_ids`` (``remap_positions_for_packed_sequence``).

    Args:
        causal: keys after the query are hidden.
        window: the sliding window (see above); None for none.
        documents: int64 ``[batch, S]`` over the global sequence, a document id per position
            and ``-1`` for padding (see :func:`documents_from`); None when every position is
            valid and the row is one document. Keep it on the device of the positions.
    """

    causal: bool = True
    window: Optional[int] = None
    documents: Optional[Tensor] = None

    def __post_init__(self) -> None:
        window = self.window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"AttentionMask(window={self.window!r}): the sliding window must be an int >= 1, or None.")
        if self.documents is not None and (self.documents.dim() != 2 or self.documents.is_floating_point()):
            raise ValueError(
                f"AttentionMask.documents must be an integer [batch, seq] tensor of document ids (-1 for padding), "
                f"got {tuple(self.documents.shape)} {self.documents.dtype}: build it with documents_from()."
            )

    def check_shape(self, batch: int, seq_len: int) -> None:
        """Raise unless ``documents`` (when set) covers the global sequence of a ``[batch, seq_len]`` batch.

        Args:
            batch: the batch size.
            seq_len: the global sequence length ``S``.
        """
        if self.documents is not None and tuple(self.documents.shape) != (batch, seq_len):
            raise ValueError(
                f"AttentionMask.documents has shape {tuple(self.documents.shape)}; it must cover the global "
                f"sequence, [batch, S] = [{batch}, {seq_len}], not this rank's share."
            )

    @property
    def masks_anything(self) -> bool:
        """Whether any rule is set (False: every query sees every key)."""
        return self.causal or self.window is not None or self.documents is not None

    def block(self, q_pos: Tensor, k_pos: Tensor) -> Optional[Tensor]:
        """The visibility of keys at ``k_pos`` to queries at ``q_pos`` (global positions).

        Args:
            q_pos: int64 ``[s_q]`` global positions of the queries.
            k_pos: int64 ``[s_k]`` global positions of the keys.

        Returns:
            A bool tensor broadcastable to ``[batch, 1, s_q, s_k]`` (True: may attend) on
            ``q_pos``'s device, or None when nothing is masked.
        """
        if not self.masks_anything:
            return None
        q, k = q_pos[:, None], k_pos[None, :]
        allowed = torch.ones(q_pos.numel(), k_pos.numel(), dtype=torch.bool, device=q_pos.device)
        if self.causal:
            allowed &= k <= q
        if self.window is not None:
            allowed &= (q - k < self.window) if self.causal else ((q - k).abs() <= self.window)
        allowed = allowed[None, None]
        if self.documents is not None:
            docs = self.documents
            q_doc = docs[:, q_pos.to(docs.device)].to(q_pos.device)
            k_doc = docs[:, k_pos.to(docs.device)].to(q_pos.device)
            same = (q_doc[:, :, None] == k_doc[:, None, :]) & (k_doc[:, None, :] >= 0)
            allowed = allowed & same[:, None]
        return allowed

    def may_attend(self, q_first: int, q_last: int, k_first: int, k_last: int) -> bool:
        """Whether the causal and window rules let any query of a position range see any key of another.

        Documents are not consulted (that would need their data on the host): False means
        the tile is certainly empty and its matmuls can be skipped; True means it may not be.

        Args:
            q_first: first global position of the queries (inclusive).
            q_last: last global position of the queries (inclusive).
            k_first: first global position of the keys (inclusive).
            k_last: last global position of the keys (inclusive).
        """
        # q - k takes every integer value in [lo, hi] over the two ranges.
        lo, hi = q_first - k_last, q_last - k_first
        if self.causal:
            upper = self.window - 1 if self.window is not None else hi
            return hi >= 0 and lo <= upper
        if self.window is not None:
            return hi >= -self.window and lo <= self.window
        return True


def documents_from(attention_mask: Optional[Tensor], position_ids: Optional[Tensor]) -> Optional[Tensor]:
    """The ``documents`` tensor of :class:`AttentionMask` from Hugging Face style inputs.

    A new document starts where ``position_ids[t] - position_ids[t - 1] != 1`` (exactly
    ``transformers.masking_utils.find_packed_sequence_indices``); positions where
    ``attention_mask`` is 0 become ``-1``.

    Note:
        Hugging Face looks for packed documents only when no 2D attention mask is given. Here
        both are applied, so a packed batch with padding keeps its documents apart. For the
        usual padded batches (position ids counting 0, 1, 2, ... over each row's valid tokens,
        or an ``arange`` over the row) the two readings agree on every valid query.

    Args:
        attention_mask: ``[batch, S]``, 1 for a token and 0 for padding; None for no padding.
        position_ids: ``[batch, S]`` or ``[1, S]`` position ids; None for one document per row.

    Returns:
        int64 ``[batch, S]`` document ids (0, 1, ... per row, -1 for padding), or None when
        every position is valid and every row is one document.
    """
    documents = None
    if position_ids is not None:
        if position_ids.dim() != 2:
            raise ValueError(f"position_ids must be [batch, seq], got shape {tuple(position_ids.shape)}.")
        if attention_mask is not None:
            position_ids = position_ids.expand(attention_mask.shape[0], -1)
        first_dummy = position_ids[:, :1] - 1  # makes the first position a continuation, as Hugging Face does
        starts = torch.diff(position_ids, prepend=first_dummy, dim=-1) != 1
        packed = starts.cumsum(-1)
        if bool((packed[:, -1] != 0).any()):
            documents = packed.to(torch.int64)
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"attention_mask must be the 2D padding mask [batch, seq] (1 token, 0 padding), "
                f"got shape {tuple(attention_mask.shape)}."
            )
        valid = attention_mask.bool()
        if not bool(valid.all()):
            if documents is None:
                documents = torch.zeros(attention_mask.shape, dtype=torch.int64, device=attention_mask.device)
            documents = documents.masked_fill(~valid, -1)
    return documents
