"""Hybrid layer patterns of Mamba stacks: Megatron-core's allocation and the pipeline split."""

from __future__ import annotations

import logging

import pytest

from megatron_ext.ssm import (
    Symbols,
    allocate_layers,
    get_layer_indices_for_pipeline_stage,
    get_layer_maps_from_layer_type_list,
)

RATIOS = [0.0, 0.05, 0.1, 0.125, 0.2, 0.25, 0.3, 1 / 3, 0.4, 0.5, 0.6, 0.75, 1.0]


def test_symbols() -> None:
    assert (Symbols.MAMBA, Symbols.ATTENTION, Symbols.MLP, Symbols.MOE) == ("M", "*", "-", "E")
    assert Symbols.VALID == {"M", "*", "-", "E"}


def test_allocation_equals_megatron_core() -> None:
    mcore = pytest.importorskip("megatron.core.ssm.mamba_hybrid_layer_allocation")
    logging.getLogger(mcore.__name__).setLevel(logging.WARNING)
    checked = 0
    for layers in [1, 2, 3, 5, 8, 9, 10, 13, 24, 30, 48, 52, 56, 64, 118]:
        for attention in RATIOS:
            for mlp in RATIOS:
                if attention + mlp > 1.0:
                    continue
                got = allocate_layers(layers, attention, mlp)
                assert got == mcore.allocate_layers(layers, attention, mlp), (layers, attention, mlp)
                checked += 1
    assert checked > 1000


def test_allocation_rules() -> None:
    # Worked by hand from the rules: attention spread evenly with Mamba first and last, then MLPs
    # spread evenly over the Mamba layers' places.
    assert "".join(allocate_layers(10, 0.2, 0.3)) == "MM-*M-*MM-"
    assert "".join(allocate_layers(8, 0.25, 0.25)) == "MM*-M*M-"
    assert "".join(allocate_layers(6, 0.0, 0.0)) == "MMMMMM"
    assert "".join(allocate_layers(4, 1.0, 0.0)) == "****"
    assert "".join(allocate_layers(4, 0.5, 0.5)) == "-**-"
    layers = allocate_layers(48, 0.5, 0.2)
    assert isinstance(layers, list) and len(layers) == 48
    assert (layers.count("*"), layers.count("-"), layers.count("M")) == (24, 10, 14)


def test_override_pattern(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="megatron_ext.ssm.mamba_hybrid_layer_allocation"):
        assert allocate_layers(9, 0.0, 0.0, "M*-M*-ME-") == list("M*-M*-ME-")
        assert allocate_layers(8, 0.25, 0.25, "MM*-M*M-") == list("MM*-M*M-")
        assert "matches the overridden pattern" in caplog.text
        caplog.clear()
        # Same counts as the ratios give, other places: accepted with a warning.
        assert allocate_layers(8, 0.25, 0.25, "MM*-MM*-") == list("MM*-MM*-")
        assert "Warning: overriding pattern A with pattern B" in caplog.text
        assert "A: MM*-M*M-" in caplog.text and "B: MM*-MM*-" in caplog.text
    # Without ratios any counts go.
    assert allocate_layers(8, 0.0, 0.0, "********") == list("********")


def test_override_pattern_refused() -> None:
    with pytest.raises(ValueError, match=r"'M\*-M\*-' has 6 layers, expected total_layers_count = 9"):
        allocate_layers(9, 0.0, 0.0, "M*-M*-")
    with pytest.raises(ValueError, match=r"has 'X' at layer 2, expected one of"):
        allocate_layers(4, 0.0, 0.0, "MMXM")
    with pytest.raises(ValueError, match=r"'M\*--M\*\*-' has layer counts .*'-': 3.*'-': 2"):
        allocate_layers(8, 0.5, 0.25, "M*--M**-")
    with pytest.raises(ValueError, match=r"has layer counts"):  # an MoE layer where an MLP is expected
        allocate_layers(8, 0.25, 0.25, "MM*EMM*-")


def test_bad_arguments_refused() -> None:
    for count in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match=rf"total_layers_count must be a positive integer, got {count}"):
            allocate_layers(count, 0.0, 0.0)
    with pytest.raises(ValueError, match=r"target_attention_ratio must be in \[0, 1\], got 1.5"):
        allocate_layers(8, 1.5, 0.0)
    with pytest.raises(ValueError, match=r"target_mlp_ratio must be in \[0, 1\], got -0.1"):
        allocate_layers(8, 0.0, -0.1)
    with pytest.raises(ValueError, match=r"target_mlp_ratio must be in \[0, 1\], got nan"):
        allocate_layers(8, 0.0, float("nan"))
    with pytest.raises(ValueError, match=r"at most 1, got 0.6 \+ 0.5"):
        allocate_layers(8, 0.6, 0.5)


def test_layer_maps() -> None:
    attention, mamba, mlp, moe = get_layer_maps_from_layer_type_list(list("M*-ME*M-"))
    assert attention == {1: 0, 5: 1}
    assert mamba == {0: 0, 3: 1, 6: 2}
    assert mlp == {2: 0, 7: 1}
    assert moe == {4: 0}
    with pytest.raises(ValueError, match=r"layer 1 has the layer type 'x'"):
        get_layer_maps_from_layer_type_list(["M", "x"])


def test_layer_maps_equal_megatron_core() -> None:
    mcore = pytest.importorskip("megatron.core.ssm.mamba_hybrid_layer_allocation")
    pattern = list("MM*-E*MEM-*-")
    assert get_layer_maps_from_layer_type_list(pattern) == list(
        mcore.get_layer_maps_from_layer_type_list(pattern)
    )


def _split(pattern: str, pp: int, vp: int | None = None, **uneven: int) -> list[list[int]]:
    """Each rank's chunks' global layer indices, rank by rank."""
    return [
        [
            get_layer_indices_for_pipeline_stage(list(pattern), pp, r, vp, c if vp else None, **uneven)
            for c in range(vp or 1)
        ]
        for r in range(pp)
    ]


def test_pipeline_stage_layers() -> None:
    pattern = "MM*-MM*-"
    assert _split(pattern, 1) == [[list(range(8))]]
    assert _split(pattern, 2) == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    # Interleaved: chunk c of rank r is virtual stage c * pp + r.
    assert _split(pattern, 2, 2) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert _split("M*-" * 4, 3, 2) == [[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5], [10, 11]]]


def test_pipeline_stage_layers_uneven() -> None:
    pattern = "M*-M*-M*-M"
    first = {"num_layers_in_first_pipeline_stage": 2}
    assert _split(pattern, 3, **first, num_layers_in_last_pipeline_stage=1) == [
        [[0, 1]], [list(range(2, 9))], [[9]]
    ]
    assert _split(pattern, 3, **first) == [[[0, 1]], [[2, 3, 4, 5]], [[6, 7, 8, 9]]]
    assert _split(pattern[:9], 3, num_layers_in_last_pipeline_stage=1) == [
        [[0, 1, 2, 3]], [[4, 5, 6, 7]], [[8]]
    ]
    # pp 2 with vp 2: rank 0's 2 layers and rank 1's 6 are split equally over the rank's chunks, in
    # virtual-stage order (r0c0, r1c0, r0c1, r1c1).
    assert _split("MM*-MM*-", 2, 2, **first) == [[[0], [4]], [[1, 2, 3], [5, 6, 7]]]


def test_pipeline_stage_without_layers_refused() -> None:
    pattern = list("MM*-MM*-")
    # Every rank refuses, naming the empty stage, also the ranks that would have had layers.
    for rank in (0, 1):
        with pytest.raises(ValueError, match=r"pipeline stage 0 of pp_size 2 x vp_size 1 gets 0 of the 8"):
            get_layer_indices_for_pipeline_stage(pattern, 2, rank, num_layers_in_first_pipeline_stage=0)
    empty = r"virtual pipeline stage 1 \(pipeline rank 1, model chunk 0\) of pp_size 2 x vp_size 2 gets 0"
    with pytest.raises(ValueError, match=empty):
        get_layer_indices_for_pipeline_stage(
            pattern, 2, 0, 2, 0, num_layers_in_first_pipeline_stage=8, num_layers_in_last_pipeline_stage=0
        )
    with pytest.raises(ValueError, match=r"pipeline stage 1 of pp_size 3 x vp_size 1 gets 0 of the 2"):
        get_layer_indices_for_pipeline_stage(list("M*"), 3, 0, num_layers_in_first_pipeline_stage=2)


def test_pipeline_split_refused() -> None:
    pattern = list("MM*-MM*-M")
    with pytest.raises(ValueError, match=r"num_layers = 9 is not divisible by .* = 2 x 1"):
        get_layer_indices_for_pipeline_stage(pattern, 2, 0)
    with pytest.raises(ValueError, match=r"pipeline stage 0 holds 3 layers, not divisible by the virtual"):
        get_layer_indices_for_pipeline_stage(pattern, 2, 0, 2, 0, num_layers_in_first_pipeline_stage=3)
    with pytest.raises(ValueError, match=r"pp_rank must be in \[0, 2\), got 2"):
        get_layer_indices_for_pipeline_stage(pattern[:8], 2, 2)
    with pytest.raises(ValueError, match=r"vp_stage must be a model chunk index in \[0, 2\)"):
        get_layer_indices_for_pipeline_stage(pattern[:8], 2, 0, 2, None)
