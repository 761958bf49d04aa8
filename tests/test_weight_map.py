"""`migrate.checkpoints.weight_map`: a declared table applied strictly both ways."""

from __future__ import annotations

import numpy as np
import pytest

from migrate.checkpoints.weight_map import Entry, WeightMap, WeightMapError, match

pytestmark = pytest.mark.compat  # the oldest stack's layer (README, Stacks)

MAP = WeightMap(
    "old -> new",
    (
        Entry("params/layers/{layer}/q/kernel", "model/layers/{layer}/query/kernel", scale=4.0),
        Entry("params/layers/{layer}/mlp/wi", "model/layers/{layer}/mlp/wi_0", moveaxis=(1, 0)),
        Entry("params/layers/{layer}/out", "model/layers/{layer}/out", transpose=(2, 0, 1)),
        Entry("params/{rest...}", "model/{rest...}"),
    ),
)


def tree() -> dict:
    rng = np.random.default_rng(0)
    return {
        ("params", "layers", "0", "q", "kernel"): rng.normal(size=(4, 2, 8)).astype(np.float32),
        ("params", "layers", "0", "mlp", "wi"): rng.normal(size=(4, 3, 5)).astype(np.float32),
        ("params", "layers", "0", "out"): rng.normal(size=(2, 3, 4)).astype(np.float32),
        ("params", "norm", "scale"): rng.normal(size=(4,)).astype(np.float32),
    }


def test_both_ways_is_bit_exact_and_every_leaf_is_moved_once():
    source = tree()
    target = MAP.forward(source)
    assert target[("model", "layers", "0", "mlp", "wi_0")].shape == (3, 4, 5)
    assert target[("model", "layers", "0", "out")].shape == (4, 2, 3)
    query = target[("model", "layers", "0", "query", "kernel")]
    np.testing.assert_array_equal(query, source[("params", "layers", "0", "q", "kernel")] * 4)
    assert target[("model", "norm", "scale")] is source[("params", "norm", "scale")]
    back = MAP.backward(target)
    assert list(back) == list(source)
    for path, array in source.items():
        assert back[path].tobytes() == array.tobytes(), path
    assert MAP.exact


def test_a_scale_that_is_not_a_power_of_two_is_not_exact():
    assert not Entry("a", "b", scale=128**0.5).exact
    assert Entry("a", "b", scale=0.25).exact


@pytest.mark.parametrize(
    ("flat", "fragment"),
    [
        ({("opt", "mu"): np.zeros(1)}, "no entry for 1 leaves: opt/mu"),
        (
            {("params", "a"): np.zeros(1), ("params", "b"): np.zeros(1)},
            None,  # distinct targets: fine
        ),
    ],
)
def test_a_leaf_no_entry_covers_is_named(flat, fragment):
    if fragment is None:
        assert len(MAP.forward(flat)) == 2
        return
    with pytest.raises(WeightMapError, match=fragment):
        MAP.forward(flat)


def test_two_leaves_onto_one_and_two_entries_for_one_leaf_are_refused():
    merge = WeightMap("merge", (Entry("a/{x}", "b/{x}"), Entry("c/{x}", "b/{x}")))
    with pytest.raises(WeightMapError, match="two leaves onto one: a/1 and c/1 -> b/1"):
        merge.forward({("a", "1"): np.zeros(1), ("c", "1"): np.zeros(1)})
    twice = WeightMap("twice", (Entry("a/{x}", "b/{x}"), Entry("{y}/k", "c/{y}")))
    with pytest.raises(WeightMapError, match=r"more than one entry for: a/k \(a/\{x\}, \{y\}/k\)"):
        twice.forward({("a", "k"): np.zeros(1)})
    # the most specific row wins over a catch-all
    specific = WeightMap("specific", (Entry("a/{x}", "b/{x}"), Entry("a/k", "c/k")))
    assert list(specific.forward({("a", "k"): np.zeros(1)})) == [("c", "k")]


def test_the_target_template_is_checked_for_paths_shapes_and_dtypes():
    produced = MAP.forward(tree())
    expected = dict(produced)
    expected[("model", "extra")] = np.zeros(1)
    expected[("model", "norm", "scale")] = np.zeros(5, np.float32)
    with pytest.raises(WeightMapError) as raised:
        MAP.check_target(produced, expected)
    assert "missing: model/extra" in str(raised.value)
    assert "model/norm/scale: (4,) float32 where (5,) float32 is expected" in str(raised.value)


def test_patterns():
    assert match("a/{x}/c", ("a", "b", "c")) == {"x": "b"}
    assert match("a/{x}/c", ("a", "b", "d")) is None
    assert match("a/{rest...}", ("a", "b", "c")) == {"rest": "b/c"}
    assert match("a/{rest...}", ("a",)) is None
    with pytest.raises(ValueError, match="fields differ"):
        Entry("a/{x}", "b/{y}")


def test_logical_names_move_with_their_axes_and_declared_renames_apply():
    row = Entry("a/{x}", "b/{x}", moveaxis=(1, 0), names=(("embed", "embed_attn"),))
    table = WeightMap("names", (row,))
    forward = table.names({("a", "k"): ("embed", "layers", "mlp")})
    assert forward == {("b", "k"): ("layers", "embed_attn", "mlp")}
    assert table.names(forward, forward=False) == {("a", "k"): ("embed", "layers", "mlp")}
    array = np.zeros((2, 3, 4))
    assert table.forward({("a", "k"): array})[("b", "k")].shape == (3, 2, 4)


def test_a_field_of_a_kind_matches_one_segment_its_expression_matches_whole():
    pattern = "p/{rest...}/{attention~self_attention(_local|_global)?}/{proj}/kernel"
    assert match(pattern, ("p", "d", "self_attention_local", "key", "kernel")) == {
        "rest": "d",
        "attention": "self_attention_local",
        "proj": "key",
    }
    assert match(pattern, ("p", "d", "self_attention", "out", "kernel")) is not None
    assert match(pattern, ("p", "d", "self_attention_x", "out", "kernel")) is None
    assert match(pattern, ("p", "d", "post_self_attention", "out", "kernel")) is None
    assert match("a/{x~.+}", ("a", "b", "c")) is None  # a kind is one segment
    with pytest.raises(ValueError, match="kinds differ"):
        Entry("a/{x~b+}", "a/{x}")
    # a kind is more specific than a plain field, less than a literal segment
    table = WeightMap(
        "kinds",
        (Entry("{x}/k", "plain/{x}"), Entry("{x~a.}/k", "kind/{x~a.}"), Entry("ab/k", "lit/ab")),
    )
    flat = {(name, "k"): np.zeros(1) for name in ("zz", "ac", "ab")}
    assert sorted(table.forward(flat)) == [("kind", "ac"), ("lit", "ab"), ("plain", "zz")]
    assert sorted(table.backward(table.forward(flat))) == sorted(flat)
    twice = WeightMap("twice", (Entry("{x~a.}/k", "b/{x~a.}"), Entry("{y~.b}/k", "c/{y~.b}")))
    with pytest.raises(WeightMapError, match="more than one entry"):
        twice.forward({("ab", "k"): np.zeros(1)})


def test_a_rename_that_would_not_come_back_is_refused_both_ways():
    table = WeightMap("names", (Entry("a/{x}", "b/{x}", names=(("embed", "embed_attn"),)),))
    assert table.names({("a", "k"): ("kv", "heads")}) == {("b", "k"): ("kv", "heads")}
    with pytest.raises(WeightMapError, match=r"(?s)\(forward\): a rename.*a/k: .*comes back as"):
        table.names({("a", "k"): ("embed_attn", "heads")})
    with pytest.raises(WeightMapError, match=r"(?s)\(backward\): a rename.*b/k: .*comes back as"):
        table.names({("b", "k"): ("embed", "heads")}, forward=False)


# MaxText 0.2.3's logical names and 0.2.5's, as each release builds them (a leaf per kind of
# parameter, from the families of configs/maxtext/: pipelined, `layers` the stage axis).
PIPELINE = "params/decoder/pipeline_module/layers/"
RELEASE_NAMES = {
    # llama2, mistral, qwen3: the attention kernels
    "self_attention/query/kernel": (
        ("layers", "embed", "q_heads", "kv"),
        ("layers", "embed_attn", "q_heads", "kv"),
    ),
    "self_attention/out/kernel": (
        ("layers", "heads", "kv", "embed"),
        ("layers", "heads", "kv", "embed_attn"),
    ),
    # gemma2: a local and a global attention per layer
    "self_attention_local/key/kernel": (
        ("layers", "embed", "kv_heads", "kv_head_dim"),
        ("layers", "embed_attn", "kv_heads", "kv_head_dim"),
    ),
    "self_attention_global/value/kernel": (
        ("layers", "embed", "kv_heads", "kv_head_dim"),
        ("layers", "embed_attn", "kv_heads", "kv_head_dim"),
    ),
    # deepseek's MLA: wkv_a has the embed dimension, wkv_b none; its router and experts
    "layers_0/self_attention/wkv_a/kernel": (
        ("layers", "embed", "kv_lora_up_proj"),
        ("layers", "embed_attn", "kv_lora_up_proj"),
    ),
    "layers_0/self_attention/wkv_b/kernel": (("layers", "kv_lora", "kv_heads", "kv_head_dim"),) * 2,
    "layers_1/DeepSeekMoeBlock_0/MoeBlock_0/gate/kernel": (
        ("layers", "embed_moe", None),
        ("layers", "embed_router", None),
    ),
    "layers_1/DeepSeekMoeBlock_0/MoeBlock_0/wi_0": (("layers", "exp", "embed_moe", "mlp_moe"),) * 2,
    "layers_1/DeepSeekMoeBlock_0/shared_experts/wo/kernel": (("layers", "mlp", "embed"),) * 2,
    # mixtral's router: `embed` in both releases
    "MoeBlock_0/gate/kernel": (("layers", "embed", None),) * 2,
    "mlp/wi_0/kernel": (("layers", "embed", "mlp"),) * 2,
    "self_attention/query_norm/scale": (("layers", "norm"),) * 2,
}


def test_the_maxtext_release_map_renames_by_the_kind_of_parameter_both_ways():
    from parity.maxtext.release_pair import RELEASES

    old = {(*PIPELINE.split("/")[:-1], *p.split("/")): n[0] for p, n in RELEASE_NAMES.items()}
    new = {(*PIPELINE.split("/")[:-1], *p.split("/")): n[1] for p, n in RELEASE_NAMES.items()}
    old[("params", "decoder", "dense_layers", "self_attention", "query", "kernel")] = (
        "embed", "dense_layers", "q_heads", "kv",
    )  # fmt: skip
    new[("params", "decoder", "dense_layers", "self_attention", "query", "kernel")] = (
        "embed_attn", "dense_layers", "q_heads", "kv",
    )  # fmt: skip
    assert RELEASES.names(old) == new
    assert RELEASES.names(new, forward=False) == old
    arrays = {path: np.zeros((2, 0)) for path in old}
    assert RELEASES.backward(RELEASES.forward(arrays)).keys() == arrays.keys()
    # a 0.2.5 leaf that still carries 0.2.3's name is not what the map declares
    stale = dict(new)
    stale[(*PIPELINE.split("/")[:-1], "self_attention_global", "key", "kernel")] = (
        "layers", "embed", "kv_heads", "kv_head_dim",
    )  # fmt: skip
    with pytest.raises(WeightMapError, match="self_attention_global/key/kernel"):
        RELEASES.names(stale, forward=False)
