"""PageAllocator: page 0 reserved, O(n) alloc/free, double frees caught without changing state."""

import pytest
import torch

from gapless.memory.allocator import PageAllocator


def test_fresh_allocator_hands_out_pages_in_order_and_never_page_0() -> None:
    a = PageAllocator(num_pages=8, page_size=4)
    assert a.num_free_pages == 7 and a.num_free_tokens == 28 and a.num_usable_pages == 7
    assert not bool(a.is_free_mask[0]) and bool(a.is_free_mask[1:].all())
    pages = a.alloc(3)
    assert pages is not None and pages.dtype == torch.int64 and pages.tolist() == [1, 2, 3]
    assert a.num_free_pages == 4
    assert a.is_free_mask.tolist() == [False, False, False, False, True, True, True, True]
    rest = a.alloc(4)
    assert rest is not None and sorted(rest.tolist()) == [4, 5, 6, 7]
    assert a.alloc(1) is None


def test_alloc_zero_and_too_many() -> None:
    a = PageAllocator(num_pages=4, page_size=2)
    empty = a.alloc(0)
    assert empty is not None and empty.numel() == 0 and empty.dtype == torch.int64
    assert a.alloc(4) is None  # only 3 usable
    assert a.num_free_pages == 3  # a failed alloc takes nothing
    with pytest.raises(ValueError):
        a.alloc(-1)


def test_alloc_result_does_not_alias_internal_state() -> None:
    a = PageAllocator(num_pages=6, page_size=1)
    pages = a.alloc(2)
    assert pages is not None
    pages.fill_(0)
    again = a.alloc(3)
    assert again is not None and sorted(again.tolist()) == [3, 4, 5]


def test_free_then_realloc_returns_freed_pages() -> None:
    a = PageAllocator(num_pages=10, page_size=1)
    pages = a.alloc(9)
    assert pages is not None
    a.free(torch.tensor([7, 2, 5]))
    assert a.num_free_pages == 3
    assert a.alloc(3).tolist() == [7, 2, 5]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "bad",
    [[0], [10], [-1], [3, 3]],
    ids=["page0", "out_of_range", "negative", "twice_in_one_call"],
)
def test_invalid_free_raises_and_changes_nothing(bad: list[int]) -> None:
    a = PageAllocator(num_pages=10, page_size=2)
    a.alloc(9)
    before = a.is_free_mask.clone()
    with pytest.raises(RuntimeError):
        a.free(torch.tensor(bad))
    assert torch.equal(a.is_free_mask, before) and a.num_free_pages == 0


def test_double_free_raises() -> None:
    a = PageAllocator(num_pages=5, page_size=1)
    pages = a.alloc(2)
    assert pages is not None
    a.free(pages)
    with pytest.raises(RuntimeError, match="double free"):
        a.free(pages[:1])
    with pytest.raises(RuntimeError, match="double free"):
        a.free(torch.tensor([4]))  # never allocated, so still free
    assert a.num_free_pages == 4


def test_free_empty_is_noop_and_accepts_int32() -> None:
    a = PageAllocator(num_pages=5, page_size=1)
    a.free(torch.empty(0, dtype=torch.int64))
    pages = a.alloc(2)
    assert pages is not None
    a.free(pages.to(torch.int32))
    assert a.num_free_pages == 4


def test_page_slots_and_pages_of() -> None:
    a = PageAllocator(num_pages=8, page_size=4)
    slots = a.page_slots(torch.tensor([3, 1]))
    assert slots.tolist() == [12, 13, 14, 15, 4, 5, 6, 7]
    assert a.pages_of(slots).tolist() == [3, 1]
    assert a.pages_of(slots[:6]).tolist() == [3, 1]  # a trailing partial page still counts
    assert a.pages_of(torch.empty(0, dtype=torch.int64)).numel() == 0
    assert PageAllocator(4, 1).page_slots(torch.tensor([2, 3])).tolist() == [2, 3]


def test_reset_frees_everything() -> None:
    a = PageAllocator(num_pages=6, page_size=1)
    a.alloc(4)
    a.reset()
    assert a.num_free_pages == 5 and a.alloc(5).tolist() == [1, 2, 3, 4, 5]  # type: ignore[union-attr]


def test_single_page_pool_has_nothing_usable() -> None:
    a = PageAllocator(num_pages=1, page_size=16)
    assert a.num_free_pages == 0 and a.alloc(1) is None
    with pytest.raises(ValueError):
        PageAllocator(num_pages=0, page_size=1)
    with pytest.raises(ValueError):
        PageAllocator(num_pages=4, page_size=0)


def test_random_alloc_free_never_hands_out_a_page_twice() -> None:
    gen = torch.Generator().manual_seed(0)
    a = PageAllocator(num_pages=64, page_size=2)
    held: list[int] = []
    for _ in range(500):
        if held and torch.rand((), generator=gen) < 0.5:
            k = int(torch.randint(1, len(held) + 1, (), generator=gen))
            idx = torch.randperm(len(held), generator=gen)[:k].tolist()
            a.free(torch.tensor([held[i] for i in idx]))
            held = [p for i, p in enumerate(held) if i not in set(idx)]
        else:
            pages = a.alloc(int(torch.randint(0, 8, (), generator=gen)))
            if pages is not None:
                assert not set(pages.tolist()) & set(held)
                held += pages.tolist()
        assert a.num_free_pages == 63 - len(held)
        assert int(a.is_free_mask.sum()) == a.num_free_pages
        assert not bool(a.is_free_mask[torch.tensor(held, dtype=torch.int64)].any())
