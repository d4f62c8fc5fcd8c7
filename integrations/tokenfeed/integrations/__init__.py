"""tokenfeed inside trainer frameworks, one module each, each an optional extra.

    from tokenfeed.integrations.transformers import FeederTrainer     # tokenfeed[transformers]
    from tokenfeed.integrations.lightning import FeederDataModule     # tokenfeed[lightning]
    from tokenfeed.integrations.torchtitan import FeederDataLoader    # tokenfeed[torchtitan]
    from tokenfeed.integrations.megatron import parse_blend           # no extra

Importing a module whose framework is not installed raises ImportError naming the
`pip install` that brings it (docs/integrations.md). This package imports none of
them: each module imports its own framework.
"""
