"""`kernel_api.nn.packed` on its own: which calls are packed rows, the offsets found, and the
answers kept per forward (per thread, per mask, renewed when a tensor changes in place)."""

from __future__ import annotations

import threading

import pytest
import torch

from kernel_api.nn import packed


def _row(lengths, heads=2, head_dim=8):
    tokens = sum(lengths)
    query = torch.zeros(1, heads, tokens, head_dim)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    sequence = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    rows = torch.arange(tokens)
    mask = ((sequence[:, None] == sequence[None, :]) & (rows[None, :] <= rows[:, None]))[None, None]
    return query, positions, mask


@pytest.fixture(autouse=True)
def _fresh():
    packed._kept.entries = []
    yield
    packed._kept.entries = []


@pytest.fixture
def checks(monkeypatch):
    made = []
    check = packed._is_block_causal
    monkeypatch.setattr(packed, "_is_block_causal", lambda *a: made.append(1) or check(*a))
    return made


def test_restarting_positions_with_their_mask_give_the_offsets_once_a_forward(checks):
    query, positions, mask = _row([3, 1, 4])
    for _ in range(3):  # (the layers of one forward)
        found = packed.plan(query, query, mask, {"position_ids": positions})
        assert found.mask is None and found.offsets.cu_seqlens_q.tolist() == [0, 3, 4, 8]
        assert (found.offsets.max_seqlen_q, found.offsets.max_seqlen_k) == (4, 4)
    assert len(checks) == 1
    positions.add_(0)  # (in place: a new version, asked again)
    packed.plan(query, query, mask, {"position_ids": positions})
    assert len(checks) == 2


def test_two_masks_alternating_are_each_checked_once(checks):
    query, positions, mask = _row([2, 5])
    other = mask.clone()
    other[0, 0, 6, 2] = False  # (a window that bites in the second sequence)
    for _ in range(3):
        assert packed.plan(query, query, mask, {"position_ids": positions}) is not None
        assert packed.plan(query, query, other, {"position_ids": positions}) is None
    assert len(checks) == 2


def test_not_a_packed_row():
    query, positions, mask = _row([4, 4])
    assert packed.plan(query.expand(2, -1, -1, -1), query, mask, {"position_ids": positions}) is None  # 2 rows
    assert packed.plan(query, query, None, {"position_ids": positions}) is None  # no mask: nothing to confine
    single = torch.arange(8)[None]
    assert packed.plan(query, query, mask, {"position_ids": single}) is None  # one sequence: not this mask
    rotary_rows = positions.expand(3, 1, -1)  # (a multimodal model's three rows of positions)
    assert packed.plan(query, query, mask, {"position_ids": rotary_rows}) is None


def test_flash_offsets_without_a_mask_and_with_another_mask():
    query, _, mask = _row([3, 5])
    cu = torch.tensor([0, 3, 8], dtype=torch.int64)
    keywords = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5, max_length_k=5)
    found = packed.plan(query, query, None, keywords)
    assert found.offsets.cu_seqlens_q.dtype == torch.int32 and found.offsets.cu_seqlens_q.tolist() == [0, 3, 8]
    assert found.offsets.cu_seqlens_q is not cu  # (its own copy)
    causal = torch.ones(8, 8, dtype=torch.bool).tril()[None, None]  # (offsets that the mask does not hold)
    confined = packed.plan(query, query, causal, keywords)
    assert confined.offsets is None and torch.equal(confined.mask, mask)


def test_answers_are_kept_per_thread(checks):
    query, positions, mask = _row([3, 3])
    packed.plan(query, query, mask, {"position_ids": positions})
    other = []
    thread = threading.Thread(target=lambda: other.append(packed.plan(query, query, mask, {"position_ids": positions})))
    thread.start()
    thread.join()
    assert other[0] is not None and len(checks) == 2  # (the other thread found its own)


def test_inference_tensors_are_recomputed_not_kept(checks):
    with torch.inference_mode():
        query, positions, mask = _row([2, 2])
        for _ in range(2):
            assert packed.plan(query, query, mask, {"position_ids": positions}) is not None
    assert len(checks) == 2
