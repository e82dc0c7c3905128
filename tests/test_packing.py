"""Bin packing: capacity, coverage, determinism, rank-even sharding, efficiency on paper-like profiles."""

import time

import numpy as np
import pytest

from prefixdpo.errors import UserError
from prefixdpo.data.packing import (
    RowTooLongError,
    auto_pack_length,
    deal_to_ranks,
    packing_efficiency,
    plan_packs,
)
from prefixdpo.data.synthetic import PROFILES, synthetic_lengths


def _random_lengths(n, seed=0, high=500):
    return np.random.default_rng(seed).integers(1, high, size=n).tolist()


def _check_plan(lengths, packs, pack_length):
    assert all(sum(lengths[i] for i in p) <= pack_length for p in packs)
    flat = sorted(i for p in packs for i in p)
    assert flat == list(range(len(lengths)))  # every index exactly once


# ---- auto_pack_length -------------------------------------------------------------------------------


def test_auto_pack_length_quantile_rule():
    lengths = list(range(1, 1001))  # q95 = 950.05 -> x1.1 = 1045.06 -> 1152
    assert auto_pack_length(lengths) == 1152


def test_auto_pack_length_never_below_longest_row():
    lengths = [100] * 99 + [1000]  # the quantile rule alone gives 128: the 1000 row could not be placed
    assert auto_pack_length(lengths) == 1024
    assert auto_pack_length([100] * 100) == 128


def test_auto_pack_length_bad_input():
    with pytest.raises(ValueError, match="no rows"):
        auto_pack_length([])
    with pytest.raises(ValueError, match="row 2"):
        auto_pack_length([5, 6, 0])


# ---- plan_packs --------------------------------------------------------------------------------------


def test_packs_fit_and_cover_every_row_once():
    lengths = _random_lengths(2000)
    for pack_length in (500, 640, 2048):
        packs = plan_packs(lengths, pack_length, seed=3, epoch=1)
        _check_plan(lengths, packs, pack_length)


def test_best_fit_decreasing_small_case():
    # 6 -> A(4 left); 5 -> B(5 left); 4 -> A (full); 3 -> B (2 left); 2 -> B (full): two full packs.
    packs = plan_packs([6, 5, 4, 3, 2], 10, shuffle=False)
    assert packs == [[0, 2], [1, 3, 4]]
    assert packing_efficiency([6, 5, 4, 3, 2], packs, 10) == pytest.approx(1.0)


def test_deterministic_per_seed_and_epoch_and_shuffled_across_epochs():
    lengths = _random_lengths(500, seed=1)
    a = plan_packs(lengths, 1024, seed=7, epoch=0)
    assert a == plan_packs(lengths, 1024, seed=7, epoch=0)
    b = plan_packs(lengths, 1024, seed=7, epoch=1)
    c = plan_packs(lengths, 1024, seed=8, epoch=0)
    assert a != b and a != c
    for packs in (b, c):
        _check_plan(lengths, packs, 1024)
    # Shuffling must not cost efficiency: same number of packs either way.
    assert abs(len(a) - len(b)) <= 1


def test_no_shuffle_ignores_seed_and_epoch():
    lengths = _random_lengths(300, seed=2)
    assert plan_packs(lengths, 700, seed=1, epoch=0, shuffle=False) == plan_packs(
        lengths, 700, seed=9, epoch=5, shuffle=False
    )


def test_row_too_long_names_index_and_lengths():
    # the user's pack_length is too small for a row: one line on the command line, not a traceback
    with pytest.raises(UserError, match=r"row 2: length 300 exceeds pack_length 256") as info:
        plan_packs([10, 20, 300], 256)
    assert isinstance(info.value, RowTooLongError) and isinstance(info.value, ValueError)
    # a non-positive row length cannot come from an Example (it refuses empty parts): a bug, not a UserError
    with pytest.raises(ValueError, match="row 1") as info:
        plan_packs([10, -1], 256)
    assert not isinstance(info.value, UserError)


def test_exact_fit_and_empty_input():
    assert plan_packs([], 128) == []
    packs = plan_packs([128, 64, 64], 128, shuffle=False)
    assert sorted(map(sorted, packs)) == [[0], [1, 2]]


def test_fast_for_100k_rows():
    lengths = np.random.default_rng(0).lognormal(np.log(250), 0.5, 100_000).astype(int) + 1
    t0 = time.perf_counter()
    packs = plan_packs(lengths.tolist(), 4096, seed=0)
    elapsed = time.perf_counter() - t0
    assert elapsed < 5.0, f"plan_packs took {elapsed:.2f}s for 100k rows"
    assert packing_efficiency(lengths, packs, 4096) > 0.98


def test_packing_efficiency_counts_empty_packs_as_waste():
    assert packing_efficiency([3, 5], [[0, 1], []], 10) == pytest.approx(8 / 20)
    assert packing_efficiency([3], [], 10) == 0.0


# ---- ranks ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("batch_size", [1, 2, 3])
@pytest.mark.parametrize("n_rows", [0, 1, 2, 5, 7, 11, 64])
def test_deal_to_ranks_every_combination(n_rows, world_size, batch_size):
    lengths = _random_lengths(n_rows, seed=n_rows, high=200)
    packs = plan_packs(lengths, 256, seed=1)
    plan = deal_to_ranks(packs, world_size, batch_size)
    assert len({len(r) for r in plan}) == 1  # every rank runs the same number of micro-batches
    assert all(len(mb) <= batch_size for r in plan for mb in r)
    # micro-batch k of all ranks together is the k-th slab of world_size x batch_size packs: the same
    # packs one process with world_size x the batch size puts in its micro-batch k
    (single,) = deal_to_ranks(packs, 1, world_size * batch_size)
    assert len(single) == len(plan[0])
    for k, mb in enumerate(single):
        assert sorted(map(tuple, (p for r in plan for p in r[k]))) == sorted(map(tuple, mb))
    assert sorted(i for r in plan for mb in r for p in mb for i in p) == list(range(n_rows))


def test_deal_to_ranks_is_strided_within_a_slab_and_checks_sizes():
    packs = [[i] for i in range(11)]
    plan = deal_to_ranks(packs, 2, 2)
    assert plan[0] == [[[0], [2]], [[4], [6]], [[8], [10]]]
    assert plan[1] == [[[1], [3]], [[5], [7]], [[9]]]
    assert deal_to_ranks([[0]], 3, 1) == [[[[0]]], [[]], [[]]]  # ranks without a line still run the step
    with pytest.raises(ValueError, match="world_size"):
        deal_to_ranks(packs, 0, 1)
    with pytest.raises(UserError, match="batch size"):
        deal_to_ranks(packs, 1, 0)


# ---- efficiency on the paper's length profiles -----------------------------------------------------


def test_hh_profile_efficiency_at_auto_length():
    prompt, resp = synthetic_lengths(PROFILES["hh-rlhf"], 4000, seed=0)
    lengths = (prompt + resp.sum(axis=1)).tolist()
    pack_length = auto_pack_length(lengths)
    packs = plan_packs(lengths, pack_length, seed=0)
    _check_plan(lengths, packs, pack_length)
    eff = packing_efficiency(lengths, packs, pack_length)
    print(f"hh-rlhf: pack_length={pack_length} efficiency={eff:.3f}")
    assert eff >= 0.9


def test_every_name_the_module_exports_exists():
    import prefixdpo.data.packing as packing

    assert all(hasattr(packing, name) for name in packing.__all__)
