"""Mask rules against a brute-force S x S mask built from Hugging Face's own mask functions."""

import itertools

import pytest
import torch

from lightning_parallel.parallel.context import AttentionMask, documents_from, local_positions

masking = pytest.importorskip("transformers.masking_utils")

SEQ = 12
# Right padding with unequal lengths; left padding (position ids as generate builds them).
ATTENTION_MASK = torch.tensor([[1] * 9 + [0] * 3, [0] * 2 + [1] * 10])
# Packed rows: documents of 3, 5, 4 tokens; 7 then 5 tokens.
PACKED_POSITIONS = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3], list(range(7)) + list(range(5))])


def hf_reference(causal, window, attention_mask, position_ids):
    """The boolean [b, S, S] mask Hugging Face composes, evaluated pair by pair."""
    if causal:
        rule = masking.causal_mask_function if window is None else masking.sliding_window_causal_mask_function(window)
    else:
        rule = (masking.bidirectional_mask_function if window is None
                else masking.sliding_window_bidirectional_mask_function(window))
    packed = None if position_ids is None else masking.find_packed_sequence_indices(position_ids)
    if packed is not None:
        rule = masking.and_masks(masking.remap_positions_for_packed_sequence(rule, position_ids),
                                 masking.packed_sequence_mask_function(packed))
    if attention_mask is not None:
        rule = masking.and_masks(rule, masking.padding_mask_function(attention_mask.bool()))
    out = torch.zeros(2, SEQ, SEQ, dtype=torch.bool)
    for b, q, k in itertools.product(range(2), range(SEQ), range(SEQ)):
        out[b, q, k] = bool(rule(torch.tensor(b), torch.tensor(0), torch.tensor(q), torch.tensor(k)))
    return out


CASES = [
    (causal, window, pad, packed)
    for causal in (True, False)
    for window in (None, 1, 3, 5)
    for pad, packed in ((False, False), (True, False), (False, True), (True, True))
]


@pytest.mark.parametrize("causal, window, pad, packed", CASES)
def test_block_matches_hugging_face_on_every_valid_query(causal, window, pad, packed):
    attention_mask = ATTENTION_MASK if pad else None
    position_ids = PACKED_POSITIONS if packed else None
    expected = hf_reference(causal, window, attention_mask, position_ids)
    mask = AttentionMask(causal=causal, window=window, documents=documents_from(attention_mask, position_ids))
    full = torch.arange(SEQ)
    got = mask.block(full, full)
    if got is None:
        assert expected.all()
        return
    got = got.expand(2, 1, SEQ, SEQ)[:, 0]
    valid = torch.ones(2, SEQ, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    assert torch.equal(got[valid], expected[valid])
    # A padding query sees nothing (Hugging Face lets it see the valid keys; its output is never used).
    assert not got[~valid].any()


@pytest.mark.parametrize("cp", [2, 3])
def test_a_block_is_the_full_mask_at_its_positions(cp):
    seq = 6 * cp
    documents = torch.randint(-1, 3, (2, seq))
    mask = AttentionMask(causal=True, window=4, documents=documents)
    full = mask.block(torch.arange(seq), torch.arange(seq))
    for qr, kr in itertools.product(range(cp), range(cp)):
        q_pos, k_pos = local_positions(seq, cp, qr), local_positions(seq, cp, kr)
        assert torch.equal(mask.block(q_pos, k_pos), full[:, :, q_pos][:, :, :, k_pos])


def test_no_rule_masks_nothing_and_position_only_rules_broadcast_over_the_batch():
    assert AttentionMask(causal=False).block(torch.arange(4), torch.arange(4)) is None
    assert AttentionMask().block(torch.arange(4), torch.arange(3)).shape == (1, 1, 4, 3)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 1, 2, 5])
def test_may_attend_is_false_exactly_when_every_pair_of_the_ranges_is_hidden(causal, window):
    mask = AttentionMask(causal=causal, window=window)
    for q0, q1, k0, k1 in itertools.product(range(0, 12, 3), range(2, 12, 3), range(0, 12, 3), range(2, 12, 3)):
        if q1 < q0 or k1 < k0:
            continue
        brute = mask.block(torch.arange(q0, q1 + 1), torch.arange(k0, k1 + 1))
        visible = True if brute is None else bool(brute.any())
        assert mask.may_attend(q0, q1, k0, k1) == visible, (q0, q1, k0, k1)


def test_documents_follow_find_packed_sequence_indices_and_padding():
    assert torch.equal(documents_from(None, PACKED_POSITIONS), masking.find_packed_sequence_indices(PACKED_POSITIONS))
    assert documents_from(None, torch.arange(SEQ)[None].expand(2, -1)) is None
    assert documents_from(torch.ones(2, SEQ), torch.arange(SEQ)[None]) is None
    assert documents_from(None, None) is None
    padded = documents_from(ATTENTION_MASK, None)
    assert padded.tolist()[0] == [0] * 9 + [-1] * 3
    both = documents_from(ATTENTION_MASK, PACKED_POSITIONS)
    assert both.tolist()[0] == [0, 0, 0, 1, 1, 1, 1, 1, 2, -1, -1, -1]
    # Left padding with generate's position ids (1 on padding, then 0, 1, ...): one document.
    left = torch.tensor([[1, 1] + list(range(10))])
    assert len(set(documents_from(ATTENTION_MASK[1:], left)[0, 2:].tolist())) == 1


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="window"):
        AttentionMask(window=0)
    with pytest.raises(ValueError, match="documents_from"):
        AttentionMask(documents=torch.zeros(SEQ))
    with pytest.raises(ValueError, match=r"\[batch, S\] = \[2, 12\]"):
        AttentionMask(documents=torch.zeros(2, 6, dtype=torch.long)).check_shape(2, SEQ)
