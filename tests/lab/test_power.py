"""`pacerl.lab.power`: intervals and minimum detectable effects against hand-computed numbers."""

from __future__ import annotations

import math

import pytest

from pacerl.lab.power import (
    fisher_exact_greater,
    mean_interval,
    minimum_detectable_effect,
    seeds_needed,
    t_quantile,
)


def test_t_quantiles_from_the_table_and_the_normal_beyond() -> None:
    assert t_quantile(0.975, 1) == 12.706 and t_quantile(0.975, 2) == 4.303 and t_quantile(0.975, 30) == 2.042
    assert t_quantile(0.8, 2) == 1.061 and t_quantile(0.8, 9) == 0.883
    assert t_quantile(0.975, 31) == 1.960 and t_quantile(0.8, 500) == 0.8416
    with pytest.raises(ValueError, match="probability"):
        t_quantile(0.9, 3)
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_quantile(0.975, 0)


def test_mean_interval_by_hand() -> None:
    # mean 2, sd 1, half-width t(0.975, 2)·1/√3 = 4.303/1.7321 = 2.4843
    interval = mean_interval([1.0, 2.0, 3.0])
    assert (interval.mean, interval.sd, interval.count) == (2.0, 1.0, 3)
    assert interval.half_width == pytest.approx(2.48434, abs=1e-5)
    assert (interval.low, interval.high) == pytest.approx((2.0 - 2.48434, 2.0 + 2.48434), abs=1e-5)
    assert interval.text(2) == "2.00 ± 2.48"
    single = mean_interval([0.5])
    assert math.isnan(single.half_width) and single.text(1) == "0.5"
    with pytest.raises(ValueError, match="no values"):
        mean_interval([])
    with pytest.raises(ValueError, match="finite"):
        mean_interval([1.0, math.nan])


def test_minimum_detectable_effect_by_hand() -> None:
    # Paired, 3 seeds, sd of the differences 0.1: (4.303 + 1.061)·0.1/√3 = 0.30969
    assert minimum_detectable_effect(0.1, 3, paired=True) == pytest.approx(0.309690, abs=1e-6)
    # Unpaired, 3 per arm: df 4, (2.776 + 0.941)·0.1·√(2/3) = 0.303492
    assert minimum_detectable_effect(0.1, 3, paired=False) == pytest.approx(0.303492, abs=1e-6)
    # More seeds shrink it; no spread, nothing to detect against.
    assert minimum_detectable_effect(0.1, 10, paired=True) < minimum_detectable_effect(0.1, 3, paired=True)
    assert minimum_detectable_effect(0.0, 5, paired=True) == 0.0
    with pytest.raises(ValueError, match="at least 2 seeds"):
        minimum_detectable_effect(0.1, 1, paired=True)
    with pytest.raises(ValueError, match="sd"):
        minimum_detectable_effect(-0.1, 3, paired=True)


def test_seeds_needed_by_hand() -> None:
    # Paired, effect = sd: (t + t)/√n <= 1 first at n = 10 ((2.262 + 0.883)/3.162 = 0.9945; n = 9 gives
    # (2.306 + 0.889)/3 = 1.065).
    assert seeds_needed(0.1, 0.1, paired=True) == 10
    # Unpaired, effect = sd: (t + t)·√(2/n) <= 1 first at n = 17 (df 32, normal: 2.8016·0.3430 = 0.961;
    # n = 16, df 30: (2.042 + 0.854)·0.3536 = 1.024).
    assert seeds_needed(0.1, 0.1, paired=False) == 17
    assert seeds_needed(0.1, 0.0, paired=True) == 2
    # An effect exactly at the MDE of n seeds needs n, not n + 1.
    assert seeds_needed(minimum_detectable_effect(0.1, 5, paired=True), 0.1, paired=True) == 5
    assert seeds_needed(1e-6, 1.0, paired=True, limit=50) is None
    with pytest.raises(ValueError, match="effect"):
        seeds_needed(0.0, 0.1, paired=True)


def test_fisher_exact_by_hand() -> None:
    # 2 of 3 against 0 of 3: two hits pooled over 6 seeds; both in the first arm: C(3,2)·C(3,0)/C(6,2) = 3/15.
    assert fisher_exact_greater(2, 3, 0, 3) == pytest.approx(0.2)
    # 3 of 3 against 0 of 3: 1/C(6,3) = 0.05, the smallest three seeds a side can give.
    assert fisher_exact_greater(3, 3, 0, 3) == pytest.approx(0.05)
    # 1 of 3 against 1 of 3: P(first >= 1) = 1 − P(first 0) = 1 − C(3,0)·C(3,2)/C(6,2) = 0.8.
    assert fisher_exact_greater(1, 3, 1, 3) == pytest.approx(0.8)
    assert fisher_exact_greater(0, 4, 2, 4) == 1.0
    with pytest.raises(ValueError, match="hits"):
        fisher_exact_greater(4, 3, 0, 3)
