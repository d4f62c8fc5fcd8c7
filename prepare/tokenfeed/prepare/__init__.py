"""Tokenize corpora into token stores: the prepare pipeline, importers, the demo corpus.

Importing this package loads no transformers, datasets or torch; the functions import
what they need when called. `tokenfeed prepare` / `tokenfeed import` (tokenfeed.cli)
are the programs around it.
"""

from __future__ import annotations

from tokenfeed.prepare.demo import build_demo_store

__all__ = ["build_demo_store"]
