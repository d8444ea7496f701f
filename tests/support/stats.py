"""Statistics the distribution tests share."""

from __future__ import annotations

from collections import Counter

from scipy import stats as scipy_stats


def chi2_pvalue(observed: Counter, exact: dict[tuple, float]) -> float:
    """Pearson χ² over the cells expected ≥ 5 times, the rest pooled in one bin; 0 if an impossible pair came."""
    n = sum(observed.values())
    if any(cell not in exact for cell in observed):
        return 0.0
    cells = sorted(exact, key=exact.get, reverse=True)
    big = [c for c in cells if n * exact[c] >= 5]
    obs = [observed[c] for c in big]
    exp = [n * exact[c] for c in big]
    rest_exp = n - sum(exp)
    if rest_exp >= 5:
        obs.append(n - sum(obs))
        exp.append(rest_exp)
    else:  # too little left to stand alone: fold it into the last bin
        obs[-1] += n - sum(obs)
        exp[-1] += rest_exp
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return float(scipy_stats.chi2.sf(stat, len(obs) - 1))
