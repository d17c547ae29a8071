"""Model shapes: parameter counts against hand-computed and published numbers, and the
llama3 flavors against the installed torchtitan source."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from amsp_dtensor.plan.cost.models import MODELS, ModelShape, get_model, llama3_ffn_hidden


def test_debugmodel_params_by_hand():
    m = MODELS["llama3_debugmodel"]
    assert (m.dim, m.n_layers, m.n_heads, m.vocab_size, m.ffn_hidden) == (256, 6, 16, 2048, 768)
    # block: 4 attention mats 256x256, 3 FFN mats 768x256, 2 norms of 256
    block = 4 * 256 * 256 + 3 * 768 * 256 + 2 * 256
    assert m.block_numel == block == 852_480
    assert m.root_numel == 2 * 2048 * 256 + 256
    assert m.num_params == 6 * block + 2 * 2048 * 256 + 256 == 6_163_712


@pytest.mark.parametrize(
    "name, params",
    [
        ("llama3_8b", 8_030_261_248),  # Llama 3 8B as published (8.03B)
        ("llama_7b", 6_738_415_616),  # LLaMA-1 7B (6.74B)
        ("llama_13b", 13_015_864_320),  # LLaMA-1 13B (13.0B)
        ("llama_30b", 32_528_943_616),  # LLaMA-1 33B (32.5B)
    ],
)
def test_published_param_counts(name, params):
    assert MODELS[name].num_params == params


def test_ffn_hidden_rule():
    # torchtitan: int(2*4d/3), times multiplier, round up to multiple_of
    assert llama3_ffn_hidden(256, 256, None) == 768
    assert llama3_ffn_hidden(4096, 1024, 1.3) == 14336
    assert llama3_ffn_hidden(8192, 4096, 1.3) == 28672
    assert llama3_ffn_hidden(16384, 4096, 1.2) == 53248


def test_units_and_shapes():
    m = MODELS["llama3_8b"]
    units = m.unit_param_shapes()
    assert len(units) == 33 and m.root_unit_index == 32
    assert units[0][1] == (8 * 128, 4096)  # wk with 8 KV heads
    assert units[-1] == [(128256, 4096), (4096,), (128256, 4096)]


def test_get_model_names_and_errors():
    assert get_model("debugmodel") is MODELS["llama3_debugmodel"]
    assert get_model("LLAMA3_8B") is MODELS["llama3_8b"]
    with pytest.raises(ValueError, match="unknown model 'gpt5'"):
        get_model("gpt5")
    with pytest.raises(ValueError, match="not divisible by n_heads"):
        ModelShape("bad", 100, 2, 3, 10, 10)


def _installed_llama3_args() -> dict:
    """llama3_args as written in the installed torchtitan (parsed, not imported: importing
    torchtitan on CPU needs the titan layer's shims)."""
    spec = importlib.util.find_spec("torchtitan")
    if spec is None:
        pytest.skip("torchtitan not installed")
    path = Path(spec.submodule_search_locations[0]) / "models" / "llama3" / "__init__.py"
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "llama3_args":
            out = {}
            for key, call in zip(node.value.keys, node.value.values):
                out[key.value] = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords
                                  if isinstance(kw.value, ast.Constant)}
            return out
    raise AssertionError("llama3_args not found in torchtitan source")


@pytest.mark.parametrize("flavor, name", [("debugmodel", "llama3_debugmodel"), ("8B", "llama3_8b"),
                                          ("70B", "llama3_70b"), ("405B", "llama3_405b")])
def test_flavors_match_installed_torchtitan(flavor, name):
    args = _installed_llama3_args()[flavor]
    m = MODELS[name]
    assert m.dim == args["dim"] and m.n_layers == args["n_layers"]
    assert m.n_heads == args["n_heads"]
    assert m.n_kv_heads == args.get("n_kv_heads")
    assert m.vocab_size == args.get("vocab_size", 128256)  # TransformerModelArgs default
    assert m.ffn_hidden == llama3_ffn_hidden(args["dim"], args.get("multiple_of", 256),
                                             args.get("ffn_dim_multiplier"))
