import collections

import pytest
import torch

from functitan.tree import (
    check_same_structure,
    combine,
    flatten_with_names,
    keystr,
    leaf_names,
    map_with_names,
    partition,
)

State = collections.namedtuple("State", "mu nu")


def test_dotted_names_follow_dicts_lists_and_namedtuple_fields():
    tree = {"layers": [{"attn": {"wq": 1}}, {"attn": {"wq": 2}}], "opt": State(mu={"w": 3}, nu=4)}
    assert leaf_names(tree) == ["layers.0.attn.wq", "layers.1.attn.wq", "opt.mu.w", "opt.nu"]
    assert keystr(("layers", 3, "attn", "wq")) == "layers.3.attn.wq"
    named, _ = flatten_with_names(tree)
    assert named[2] == ("opt.mu.w", 3)


def test_structure_mismatch_names_the_key_path_and_both_structures():
    a = {"layers": [{"attn": {"wq": 1}}, {"attn": {"wq": 2}}]}
    b = {"layers": [{"attn": {"wq": 1}}, {"attn": {"w_q": 2}}]}
    with pytest.raises(ValueError) as err:
        check_same_structure(a, b, "params", "specs")
    msg = str(err.value)
    assert "differ at 'layers.1.attn'" in msg
    assert "keys only in the first: ['wq']" in msg and "keys only in the second: ['w_q']" in msg
    assert "params: {'layers': [{'attn': {'wq': *}}" in msg and "specs: {'layers'" in msg


def test_length_mismatch_and_map_with_names_error():
    a = {"layers": [1, 2, 3]}
    b = {"layers": [1, 2]}
    with pytest.raises(ValueError, match=r"differ at 'layers': length 3 vs 2"):
        map_with_names(lambda n, x, y: x, a, b, what=("params", "grads"))


def test_map_with_names_passes_names_and_rest_leaves():
    out = map_with_names(lambda n, x, y: f"{n}={x + y}", {"a": [1, 2]}, {"a": [10, 20]})
    assert out == {"a": ["a.0=11", "a.1=22"]}


def test_partition_and_combine_round_trip():
    tree = {"w": torch.ones(2, 2), "b": torch.zeros(2)}
    matrices, rest = partition(tree, lambda name, x: x.ndim == 2)
    assert matrices["b"] is None and rest["w"] is None
    back = combine(matrices, rest)
    assert torch.equal(back["w"], tree["w"]) and torch.equal(back["b"], tree["b"])
