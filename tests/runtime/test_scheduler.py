"""The engine's integer bookkeeping (runtime/engine/scheduler.py): page ids handed out, given back and
grown, with no room answered by None rather than an exception."""

from __future__ import annotations

from jitllm.runtime.engine.scheduler import PageAllocator, initial_pages, pages_for


def test_ids_come_lowest_first_and_return_to_the_top_of_the_stack():
    ids = PageAllocator()
    ids.extend(4)
    assert ids.take(3) == [0, 1, 2] and ids.take(2) is None and ids.free == [3]
    ids.give_back([1, 2])
    assert ids.take(2) == [1, 2]  # what was freed last comes back first, in its order


def test_growth_doubles_up_to_the_limit_and_says_none_past_it():
    ids = PageAllocator()
    ids.extend(4)
    assert ids.take(4) == [0, 1, 2, 3]
    assert ids.growth(1, None) == 8 and ids.growth(9, None) == 13
    assert ids.growth(2, 5) is None and ids.growth(1, 5) == 5
    ids.extend(6)
    assert ids.take(2) == [4, 5] and ids.capacity == 6


def test_page_counts():
    assert [pages_for(n, 16) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]
    assert initial_pages(blocks=3, ctx=4096, page_size=16) == 3 * 64 and initial_pages(0, 8, 16) == 1
