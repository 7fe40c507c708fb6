"""The model splitter: a user's model as layers and the stages built from them.

An ``nn.Sequential`` splits at its children; any other model is traced with
``torch.fx`` around its blocks into segments (docs/design.md §2.1).
"""

__all__: list[str] = []
