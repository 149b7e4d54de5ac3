"""The learning plane: the hub that trains the policy and serves the peers (`echo2-hub`).

`Run` is its Python API (`echo2p2p.hub.api`); everything else is reached by module.
"""

from .api import Run

__all__ = ["Run"]
