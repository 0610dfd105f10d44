"""An engine that loses a rank: the simulated engine until its tenth step, then `EngineLost`, as
rank 0's controller raises it when a rank process dies (for tests of what a run does then)."""
from __future__ import annotations

from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.step import EngineLost

LOST = "rank 1 was killed by SIGKILL (during its step 10)"


class LosesARank(SimEngine):
    def launch(self, step):
        self.num_launched = getattr(self, "num_launched", 0) + 1
        if self.num_launched == 10:
            raise EngineLost(LOST)
        return super().launch(step)
