"""Chi-square helpers for the distribution tests (torch only, no scipy)."""

from __future__ import annotations

from collections import Counter

import torch


def chi2_sf(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X ~ chi-square(dof): the upper regularised incomplete gamma."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(statistic / 2.0)))


def goodness_of_fit(observed: Counter, expected_probs: dict[int, float], n: int) -> float:
    """p-value of observed counts (n draws) against expected_probs; tokens expected fewer
    than 5 times are pooled into one bin, as the chi-square approximation needs."""
    big = {t: p for t, p in expected_probs.items() if p * n >= 5}
    bins = [(observed[t], p * n) for t, p in big.items()]
    rest_expected = n - sum(e for _, e in bins)
    rest_observed = n - sum(o for o, _ in bins)
    if rest_expected >= 5:
        bins.append((rest_observed, rest_expected))
    elif rest_observed:
        return 0.0  # observed a token the expected distribution (almost) never draws
    statistic = sum((o - e) ** 2 / e for o, e in bins)
    return chi2_sf(statistic, len(bins) - 1)


def homogeneity(a: Counter, b: Counter) -> float:
    """p-value that two samples come from one distribution (two-sample chi-square); tokens
    seen fewer than 10 times in both together are pooled into one bin."""
    na, nb = sum(a.values()), sum(b.values())
    tokens = [t for t in a.keys() | b.keys() if a[t] + b[t] >= 10]
    table = [(a[t], b[t]) for t in tokens]
    rest = (na - sum(x for x, _ in table), nb - sum(y for _, y in table))
    if sum(rest) > 0:
        table.append(rest)
    statistic = 0.0
    for x, y in table:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            statistic += (observed - expected) ** 2 / expected
    return chi2_sf(statistic, len(table) - 1)
