"""Group advantages and their token broadcast (titan_rl_ext.rl.advantages)."""

from __future__ import annotations

import math

import pytest
import torch

from titan_rl_ext.rl.advantages import (
    broadcast_to_tokens,
    group_advantages,
    group_ids_from_size,
    zero_variance_groups,
)


def test_grpo_std_normalised_hand_computed() -> None:
    r_N = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0])  # two groups of G=3
    adv = group_advantages(r_N, 3)
    # group 0: [1,0,0] mean 1/3, unbiased std sqrt(((2/3)^2 + 2*(1/3)^2)/2) = sqrt(1/3)
    s0 = math.sqrt(1 / 3)
    # group 1: [1,3,1] mean 5/3, deviations [-2/3, 4/3, -2/3], unbiased var (4/9+16/9+4/9)/2 = 4/3
    s1 = math.sqrt(4 / 3)
    eps = 1e-6
    expected = torch.tensor([(2 / 3) / (s0 + eps), (-1 / 3) / (s0 + eps), (-1 / 3) / (s0 + eps),
                             (-2 / 3) / (s1 + eps), (4 / 3) / (s1 + eps), (-2 / 3) / (s1 + eps)])
    torch.testing.assert_close(adv, expected)


def test_dr_grpo_no_std_and_population_std() -> None:
    r_N = torch.tensor([1.0, 0.0, 0.0, 1.0])
    torch.testing.assert_close(group_advantages(r_N, 4, normalize_std=False), torch.tensor([0.5, -0.5, -0.5, 0.5]))
    # population std of [1,0,0,1] is 0.5
    torch.testing.assert_close(group_advantages(r_N, 4, unbiased_std=False, eps=0.0), torch.tensor([1.0, -1, -1, 1]))


@pytest.mark.parametrize("normalize_std", [True, False])
def test_all_equal_groups_get_exact_zero(normalize_std: bool) -> None:
    # 0.1 * 3 / 3 != 0.1 in floating point: without the explicit guard the residue / eps would
    # make a large spurious advantage
    r_N = torch.tensor([0.1, 0.1, 0.1, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    adv = group_advantages(r_N, 3, normalize_std=normalize_std)
    assert torch.isfinite(adv).all()
    assert (adv[:9] == 0).all()
    assert adv[10] > 0 and adv[9] < 0

    r32 = torch.full((4,), 0.7)
    assert (group_advantages(r32, 4) == 0).all()


def test_variable_groups_by_id_and_singleton() -> None:
    # ids need not be contiguous or sorted; a group of one has no baseline to compare with
    r_N = torch.tensor([1.0, 5.0, 0.0, 7.0, 2.0])
    ids = torch.tensor([9, 3, 9, 3, 4])
    adv = group_advantages(r_N, group_ids_N=ids, normalize_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -1.0, -0.5, 1.0, 0.0]))
    adv_std = group_advantages(r_N, group_ids_N=ids)
    assert adv_std[4] == 0 and torch.isfinite(adv_std).all()
    # same result as the contiguous layout after reordering
    perm = torch.tensor([0, 2, 1, 3])
    torch.testing.assert_close(group_advantages(r_N[perm], 2), adv_std[perm])


def test_zero_variance_groups_and_errors() -> None:
    r_N = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert zero_variance_groups(r_N, 2).tolist() == [True, True, False, False, True, True]
    assert group_ids_from_size(6, 3).tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError):
        group_advantages(r_N, 4)
    with pytest.raises(ValueError):
        group_advantages(r_N)
    assert group_advantages(torch.zeros(0), 4).numel() == 0


def test_broadcast_to_tokens() -> None:
    adv_N = torch.tensor([0.5, -2.0])
    lengths = [4, 3]
    mask_T = torch.tensor([0, 0, 1, 1, 0, 1, 1], dtype=torch.bool)
    expected = torch.tensor([0, 0, 0.5, 0.5, 0, -2.0, -2.0])
    torch.testing.assert_close(broadcast_to_tokens(adv_N, lengths=lengths, mask_T=mask_T), expected)
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)  # SeqBatch.cu_seqlens layout
    torch.testing.assert_close(broadcast_to_tokens(adv_N, cu, mask_T=mask_T), expected)
    torch.testing.assert_close(broadcast_to_tokens(adv_N, cu), torch.tensor([0.5] * 4 + [-2.0] * 3))
    with pytest.raises(ValueError):
        broadcast_to_tokens(adv_N, lengths=[1, 2, 3])
    with pytest.raises(ValueError):
        broadcast_to_tokens(adv_N, cu, mask_T=torch.ones(5, dtype=torch.bool))
