"""What the document outputs exist for, in torch on CPU (fp32): attention over a packed
row with the mask made from `document_ids` (and absolute positions at `position_ids`)
equals causal attention over each document on its own; `cu_seqlens` cut the row where
per-document attention does."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenfeed.core import documents as D

from support import fewer_examples

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _with_positions(x, positions, seed: int):
    """x [H, L, D] plus a learned-style absolute position embedding at `positions`
    (absolute, unlike RoPE, so it only matches per-document attention when the
    positions restart at 0 in each document)."""
    g = torch.Generator().manual_seed(seed + 1)
    table = torch.randn(256, x.shape[-1], generator=g)
    return x + table[positions]


def _packed_row(lengths: list[int], heads: int, dim: int, seed: int):
    """One packed row of documents of the given lengths (the last one cut, as a window
    cuts it: its end is not in the row), its q/k/v and its document outputs."""
    seq_len = sum(lengths)
    ends = (np.cumsum(lengths) - 1)[:-1]
    out = D.from_ends(ends, 1, seq_len, 1)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(heads, seq_len, dim, generator=g) for _ in range(3))
    return seq_len, out, q, k, v


def _per_document(lengths: list[int], q, k, v, seed: int | None = None):
    """Causal attention over each document alone (with `seed`: position embeddings
    from 0 in each document)."""
    outs, at = [], 0
    for n in lengths:
        qs, ks, vs = q[:, at : at + n], k[:, at : at + n], v[:, at : at + n]
        if seed is not None:
            p = torch.arange(n)
            qs, ks, vs = (_with_positions(x, p, seed) for x in (qs, ks, vs))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True))
        at += n
    return torch.cat(outs, dim=1)


doc_lengths = st.lists(st.one_of(st.just(1), st.integers(1, 40)), min_size=1, max_size=6)


@fewer_examples(4)  # attention in torch, twice each
@given(doc_lengths, st.integers(0, 2**31 - 1), st.booleans())
def test_document_mask_equals_attention_per_document(lengths, seed, embed) -> None:
    seq_len, out, q, k, v = _packed_row(lengths, heads=2, dim=8, seed=seed)
    docs = torch.from_numpy(out["document_ids"][0])
    pos = torch.from_numpy(out["position_ids"][0])
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    allowed = causal & (docs[:, None] == docs[None, :])
    qp, kp, vp = (_with_positions(x, pos, seed) for x in (q, k, v)) if embed else (q, k, v)
    packed = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=allowed)
    lone = _per_document(lengths, q, k, v, seed if embed else None)
    torch.testing.assert_close(packed, lone, rtol=1e-5, atol=1e-5)


@fewer_examples(4)  # attention in torch, per segment and per document
@given(doc_lengths, st.integers(0, 2**31 - 1))
def test_varlen_segments_are_the_documents(lengths, seed) -> None:
    _seq_len, out, q, k, v = _packed_row(lengths, heads=2, dim=8, seed=seed)
    cu = out["cu_seqlens"].tolist()
    assert np.diff(cu).tolist() == lengths
    assert out["max_seqlen"] == max(lengths)
    per_segment = torch.cat(
        [
            F.scaled_dot_product_attention(q[:, a:b], k[:, a:b], v[:, a:b], is_causal=True)
            for a, b in itertools.pairwise(cu)
        ],
        dim=1,
    )
    torch.testing.assert_close(per_segment, _per_document(lengths, q, k, v))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@fewer_examples(15)  # a block mask built and flex attention run in eager mode each
@given(doc_lengths, st.integers(0, 2**31 - 1))
def test_flex_attention_document_mask(lengths, seed) -> None:
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    seq_len, out, q, k, v = _packed_row(lengths, heads=2, dim=8, seed=seed)
    docs = torch.from_numpy(out["document_ids"][0])

    def document_causal(b, h, qi, ki):
        return (qi >= ki) & (docs[qi] == docs[ki])

    block = flex.create_block_mask(document_causal, None, None, seq_len, seq_len, device="cpu")
    packed = flex.flex_attention(q[None], k[None], v[None], block_mask=block)[0]
    torch.testing.assert_close(packed, _per_document(lengths, q, k, v), rtol=1e-5, atol=1e-5)
