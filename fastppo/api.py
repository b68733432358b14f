"""``fastppo.PPOTrainer``: the one name TRL's users import for both of TRL's trainer APIs.

TRL 0.26's constructor (``args=``, ``processing_class=``, ...) builds the core trainer (``fastppo.trainer``);
a legacy TRL (<= 0.11) config or legacy arguments build the legacy adapter (``fastppo.legacy``), which is
itself built on the core trainer. The choice lives here, above both, so neither module imports the other
upward (the core trainer knows nothing of the legacy API).
"""
from __future__ import annotations

from fastppo import legacy
from fastppo.trainer import PPOTrainer as CorePPOTrainer


class PPOTrainer(CorePPOTrainer):
    __doc__ = CorePPOTrainer.__doc__ + """
    Given a legacy TRL (<= 0.11) config or legacy arguments (a model in second place, a legacy-only
    keyword), ``fastppo.PPOTrainer(...)`` returns the legacy API's trainer (``fastppo.legacy.PPOTrainer``).
    """

    def __new__(cls, *args, **kwargs):
        if cls is PPOTrainer and legacy.is_legacy_call(args, kwargs):
            return legacy.PPOTrainer(*args, **kwargs)
        return super().__new__(cls)
