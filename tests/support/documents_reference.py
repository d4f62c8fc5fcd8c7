"""Deliberately simple references for the document tests: Python loops straight from
the definitions (docs/documents.md, "What the client builds"), sharing no code with
tokenfeed.core.documents. Two independent ones:

- `from_tokens`: walks a batch buffer token by token, an end being `is_end(row, col)`;
- `from_documents`: knows which document every absolute store offset belongs to
  (document i is T[doc_ends[i-1] : doc_ends[i]]) and compares documents, never EOS.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

IGNORE = -100


def _outputs(
    positions: list[list[int]], documents: list[list[int]], labels: list[list[int]]
) -> dict[str, object]:
    """The batch's outputs from its rows' lists; cu_seqlens and max_seqlen follow from
    each row's per-token document ids."""
    cu, at, longest = [], 0, 0
    for docs in documents:
        run = 0
        for j, d in enumerate(docs):
            if j == 0 or d != docs[j - 1]:
                cu.append(at + j)
                run = 0
            run += 1
            longest = max(longest, run)
        at += len(docs)
    cu.append(at)
    return {
        "position_ids": positions,
        "document_ids": documents,
        "labels": labels,
        "cu_seqlens": cu,
        "max_seqlen": longest,
    }


def from_tokens(
    buf: Sequence[Sequence[int]], is_end: Callable[[int, int], bool], seq_len: int, shift: int
) -> dict[str, object]:
    positions, documents, labels = [], [], []
    for r, row in enumerate(buf):
        assert len(row) == seq_len + shift
        pos, doc = [], []
        p = d = 0
        for j in range(seq_len):
            if j > 0 and is_end(r, j - 1):
                p, d = 0, d + 1
            pos.append(p)
            doc.append(d)
            p += 1
        lab = []
        for j in range(seq_len):
            crosses = False
            for k in range(j, j + shift):
                if is_end(r, k):
                    crosses = True
            lab.append(IGNORE if crosses else int(row[j + shift]))
        positions.append(pos)
        documents.append(doc)
        labels.append(lab)
    return _outputs(positions, documents, labels)


def from_documents(
    tokens: Sequence[int], starts: Sequence[int], doc_ends: Sequence[int], seq_len: int, shift: int
) -> dict[str, object]:
    def doc_of(p: int) -> int:
        return bisect.bisect_right(doc_ends, p)

    def doc_start(i: int) -> int:
        return 0 if i == 0 else doc_ends[i - 1]

    positions, documents, labels = [], [], []
    for s in starts:
        first = doc_of(s)
        pos, doc, lab = [], [], []
        for j in range(seq_len):
            here = doc_of(s + j)
            pos.append(min(j, s + j - doc_start(here)))
            doc.append(here - first)
            target = s + j + shift
            lab.append(IGNORE if doc_of(target) != here else int(tokens[target]))
        positions.append(pos)
        documents.append(doc)
        labels.append(lab)
    return _outputs(positions, documents, labels)
