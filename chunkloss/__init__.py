"""chunkloss: chunked fused LM-head losses for post-training without materialised logits."""

from chunkloss.engine import *  # noqa: F403
from chunkloss.engine import __all__ as _engine_all
from chunkloss.losses import *  # noqa: F403
from chunkloss.losses import __all__ as _losses_all

__version__ = "0.2.0"

__all__ = [*_engine_all, *_losses_all]
