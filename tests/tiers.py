"""One check in both CPU tiers: `@pytest.mark.parametrize("full", SWEEP)` runs a test with
full=False in the fast tier (a sample that still reaches every branch the check is about) and
with full=True in the quality tier (`-m quality`: the whole sweep, which CI runs after the fast
tier). The fast tier is the README's test command, held to 600 CPU-seconds on 2 cores."""
from __future__ import annotations

import pytest

SWEEP = [pytest.param(False, id="sample"), pytest.param(True, id="full", marks=pytest.mark.quality)]
