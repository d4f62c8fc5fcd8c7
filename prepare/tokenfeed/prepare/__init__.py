"""Tokenize corpora into token stores: `tokenfeed prepare`, `tokenfeed import`, the demo.

Importing this package loads no transformers, datasets or torch; the functions below
import what they need when called.
"""

from __future__ import annotations

from tokenfeed.prepare.demo import build_demo_store

__all__ = ["build_demo_store"]
