"""Placement maps: syntax, errors, validation against a model and -devices."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jitllm.core.errors import JitllmError
from jitllm.runtime.placement import Placement, PlacementOption, parse_placement, with_placement

EXAMPLE = "0=host,1-7=cuda:0,8=host!,9-15=vulkan:1~,head=vulkan:1"


def test_the_documented_example():
    p = parse_placement(EXAMPLE)
    kinds = [(e.kind, e.start, e.end, e.target, e.pinned, e.streamed) for e in p.entries]
    assert kinds == [
        ("index", 0, 0, "host", False, False),
        ("range", 1, 7, "cuda:0", False, False),
        ("index", 8, 8, "host", True, False),
        ("range", 9, 15, "vulkan:1", False, True),
        ("head", None, None, "vulkan:1", False, False),
    ]
    assert str(p) == EXAMPLE
    assert p.entry_for(5).text == "1-7=cuda:0"
    assert p.entry_for(16) is None
    assert p.head().target == "vulkan:1"


def test_star_covers_only_blocks_no_other_entry_names():
    p = parse_placement("*=cuda:0~, 3=host")
    assert p.entry_for(3).target == "host"
    assert p.entry_for(4).kind == "star" and p.entry_for(4).streamed
    assert p.head() is None


@pytest.mark.parametrize("suffix", ["!~", "~!", " ~ ! "])
def test_suffixes_in_either_order(suffix):
    (entry,) = parse_placement(f"2=CUDA:0{suffix}").entries
    assert entry.pinned and entry.streamed and entry.target == "cuda:0"


@pytest.mark.parametrize(
    "text,message",
    [
        ("3-1=host", r"^placement 3-1=host: range 3-1 is backwards$"),
        ("1=host,,2=host", r"^placement 1=host,,2=host: empty entry$"),
        ("1=host,", r"empty entry"),
        ("  ", r"^-placement is empty"),
        ("1host", r"^placement 1host: missing '='"),
        ("x=host", r"^placement x=host: bad selector 'x'"),
        ("-1=host", r"bad selector '-1'"),
        ("1=", r"^placement 1=: missing or bad target"),
        ("1=cuda:0?", r"^placement 1=cuda:0\?: unknown suffix '\?'"),
        ("1=cuda:0!!", r"suffix '!' given twice"),
        ("1=host~", r"only a device can stream"),
        ("head=cuda:0~", r"the head cannot be streamed"),
        ("1-7=cuda:0,3=host", r"^placement 3=host: overlaps 1-7=cuda:0$"),
        ("2=host,2=cuda:0", r"overlaps 2=host"),
        ("*=host,*=cuda:0", r"^placement \*=cuda:0: overlaps \*=host$"),
        ("head=host,HEAD=cuda:0", r"overlaps head=host"),
    ],
)
def test_errors_name_the_entry(text, message):
    with pytest.raises(JitllmError, match=message):
        parse_placement(text)


def test_validate_against_model_and_devices():
    p = parse_placement("0=host,40=cuda:0")
    with pytest.raises(
        JitllmError, match=r"^placement 40=cuda:0: block 40 is past the model's last block 29$"
    ):
        p.validate(30, {"cuda:0"})
    with pytest.raises(JitllmError, match=r"block 30 is past the model's last block 29$"):
        parse_placement("25-31=host").validate(30, set())
    with pytest.raises(JitllmError, match=r"^placement 5=cuda:1: cuda:1 is not in -devices$"):
        parse_placement("5=cuda:1,head=host").validate(30, {"cuda:0"})
    parse_placement("0-29=Cuda:0,head=host,*=host").validate(30, {"CUDA:0"})


def test_with_placement_takes_text_or_a_placement():
    option = with_placement("*=cuda:0~", strict=True)
    assert option == PlacementOption(parse_placement("*=cuda:0~"), True)
    assert with_placement(option.placement).strict is False
    with pytest.raises(JitllmError):
        with_placement("nonsense")


@settings(max_examples=500, deadline=None)
@given(
    st.text(alphabet=st.sampled_from(list("0123456789-=,*!~ hostcuda:vulkanHEADx?\n")), max_size=30)
    | st.text()
)
def test_any_text_parses_or_raises_jitllm_error(text):
    try:
        p = parse_placement(text)
    except JitllmError as e:
        assert len(str(e).splitlines()) == 1
    else:
        assert isinstance(p, Placement) and parse_placement(str(p)) == p


selectors = st.one_of(
    st.integers(0, 40).map(str),
    st.tuples(st.integers(0, 40), st.integers(0, 40)).map(lambda ab: f"{min(ab)}-{max(ab)}"),
    st.just("head"),
    st.just("*"),
)
targets = st.sampled_from(["host", "cuda:0", "vulkan:1", "metal"])
suffixes = st.sampled_from(["", "!", "~", "!~", "~!"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(selectors, targets, suffixes), min_size=1, max_size=6))
def test_well_formed_maps_round_trip_or_fail_cleanly(entries):
    text = ",".join(f"{s}={t}{x}" for s, t, x in entries)
    try:
        p = parse_placement(text)
    except JitllmError as e:
        assert len(str(e).splitlines()) == 1
        return
    assert str(p) == text
    try:
        p.validate(30, {"cuda:0", "vulkan:1"})
    except JitllmError as e:
        assert len(str(e).splitlines()) == 1
