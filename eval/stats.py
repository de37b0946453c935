"""The statistics of the quality tables: 95% intervals of accuracies, paired tests between rows.

Both come from :mod:`scipy.stats` (``binomtest``): the Wilson score interval of a binomial
proportion (Wilson 1927; recommended over the normal approximation for small ``n`` and
proportions near 0 or 1 by Brown, Cai & DasGupta 2001), and McNemar's exact test of two rows
answered on the same samples: under the null, each discordant sample (one row right, the other
wrong) favours either row with probability 1/2, so the two-sided p-value is a binomial test of the
discordant counts (McNemar 1947; the exact form as in Fagerland, Lydersen & Laake 2013).
"""

from __future__ import annotations

from dataclasses import dataclass

from scipy.stats import binomtest


def wilson(correct: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval ``(low, high)`` of ``correct`` successes in ``n`` trials; ``(0, 1)``
    for ``n == 0``. Raises ``ValueError`` unless ``0 <= correct <= n``."""
    if not 0 <= correct <= n:
        raise ValueError(f"need 0 <= correct <= n, got correct={correct}, n={n}")
    if n == 0:
        return 0.0, 1.0
    ci = binomtest(correct, n).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


@dataclass(frozen=True)
class Paired:
    """Two rows on the same ``n`` samples: ``only_a`` samples right for row a only, ``only_b`` for
    row b only; ``p`` the two-sided exact McNemar p-value."""

    n: int
    only_a: int
    only_b: int
    p: float

    @property
    def difference(self) -> float:
        """Accuracy of a minus accuracy of b (a fraction)."""
        return (self.only_a - self.only_b) / self.n if self.n else 0.0


def mcnemar(a: dict, b: dict) -> Paired:
    """Exact McNemar test of two rows' per-sample outcomes ``{sample: correct (bool)}`` over the
    samples both answered. Raises ``ValueError`` if they share none."""
    common = sorted(set(a) & set(b))
    if not common:
        raise ValueError("the two rows share no sample")
    only_a = sum(1 for s in common if a[s] and not b[s])
    only_b = sum(1 for s in common if b[s] and not a[s])
    discordant = only_a + only_b
    p = 1.0 if discordant == 0 else float(binomtest(only_a, discordant, 0.5).pvalue)
    return Paired(len(common), only_a, only_b, p)
