"""`jaxcomp.advise` / `python -m jaxcomp.bench advise`: methods ranked by predicted step, with fidelity."""

import json
import os

import jax
import jax.numpy as jnp
import pytest

import jaxcomp
from jaxcomp_bench import advise as adv

ROOT = os.path.dirname(os.path.dirname(__file__))
TREE = {"w1": jax.ShapeDtypeStruct((512, 256), jnp.float32), "b1": jax.ShapeDtypeStruct((256,), jnp.float32),
        "w2": jax.ShapeDtypeStruct((256, 1024), jnp.float32)}
METHODS = ["none", "bf16", "topk", "powersgd", "signsgd", "qsgd"]


def test_bundled_fidelity_is_the_suite_tables_of_docs_recipes():
  with open(os.path.join(ROOT, "docs", "recipes.md")) as f:
    parsed = adv.fidelity_from_recipes(f.read())
  assert adv.load_json("fidelity.json")["methods"] == parsed
  assert set(jaxcomp.METHODS) - {"none"} <= set(parsed)


def test_ranked_by_predicted_step_with_bytes_from_the_layout():
  rows = jaxcomp.advise(TREE, gbps=1.0, workers=8, compute_s=0.01, methods=METHODS)
  assert [r.step for r in rows] == sorted(r.step for r in rows)
  by = {r.method: r for r in rows}
  assert by["none"].speedup == pytest.approx(1.0)
  assert by["none"].bytes == 4 * (512 * 256 + 256 + 256 * 1024)
  assert by["bf16"].bytes < 0.51 * by["none"].bytes
  assert by["diloco H=16"].bytes == pytest.approx(by["none"].bytes / 16)
  assert by["none"].compression == 0.0 and by["topk"].compression > 0.0  # the H200 table's top-k
  for r in rows:  # step = compute + compression + communication (no overlap)
    assert r.step == pytest.approx(0.01 + r.compression + r.communication)


def test_bytes_and_fidelity_are_the_same_recipe():
  """random-k's SGD recipe sends a quarter of the entries (ratio=0.25), and its fidelity is that recipe's."""
  sgd = {r.method: r for r in jaxcomp.advise(TREE, 1.0, 8, 0.01, methods=["randomk"], diloco=())}
  adam = {r.method: r for r in jaxcomp.advise(TREE, 1.0, 8, 0.01, methods=["randomk"], diloco=(),
                                               optimizer="adamw")}
  assert sgd["randomk"].bytes == pytest.approx(0.25 * sgd["none"].bytes, rel=0.01)
  fid = adv.load_json("fidelity.json")["methods"]["randomk"]
  assert sgd["randomk"].fidelity == {"sgd": tuple(fid["sgd"])}
  assert adam["randomk"].fidelity == {"adamw": tuple(fid["adamw"])}


def test_the_choice_flips_with_the_bandwidth():
  slow = jaxcomp.advise(TREE, gbps=0.01, workers=8, compute_s=0.001, methods=METHODS, diloco=())
  fast = jaxcomp.advise(TREE, gbps=1e7, workers=8, compute_s=0.001, methods=METHODS, diloco=(), latency_us=0)
  assert slow[0].method != "none" and slow[0].speedup > 5
  assert fast[0].method in ("none", "bf16")  # on a link this fast compression costs more than it saves
  assert [r.method for r in fast].index("topk") > [r.method for r in fast].index("none")


def test_a_method_the_kernel_table_lacks_is_left_out_not_priced_free():
  kernels = {"cases": [{"method": "none", "case": "c", "seconds": 1e-3, "values": 1000},
                       {"method": "topk", "case": "c", "seconds": 3e-3, "values": 1000}]}
  rows = jaxcomp.advise(TREE, 1.0, 8, 0.01, methods=["topk", "bf16"], kernels=kernels, diloco=())
  assert {r.method for r in rows} == {"none", "topk"}
  assert "bf16" in adv.unmeasured(kernels) and "fp4" in adv.unmeasured()  # the bundled H200 table


def test_frontier_is_not_dominated():
  rows = jaxcomp.advise(TREE, gbps=1.0, workers=8, compute_s=0.01)
  front = adv.frontier(rows)
  assert front and all(adv.pass_rate(r) is not None for r in front)
  for f in front:
    assert not any(r.step < f.step and adv.pass_rate(r) is not None and adv.pass_rate(r) > adv.pass_rate(f)
                   for r in rows)


def test_two_levels_price_the_slow_links_between_nodes():
  flat = {r.method: r for r in jaxcomp.advise(TREE, 1.0, 32, 0.01, methods=["topk"], diloco=())}
  two = {r.method: r for r in jaxcomp.advise(TREE, 1.0, 32, 0.01, methods=["topk"], diloco=(), per_node=8,
                                              intra_gbps=400.0)}
  assert two["none"].bytes == flat["none"].bytes  # the same program, another network
  assert two["none"].communication < flat["none"].communication  # 4 nodes share the slow links, not 32


def test_llama_sizes():
  from jaxcomp_bench import shapes

  assert abs(shapes.llama_params("8b") - 8.03e9) < 0.01e9 and abs(shapes.llama_params("70b") - 70.6e9) < 0.1e9
  tree, compute, _ = adv.model_tree("llama-1b")
  assert 0 < compute < adv.model_tree("llama-8b")[1]


@pytest.mark.parametrize("kwargs, name", [({"workers": 1}, "workers"), ({"gbps": 0.0}, "gbps"),
                                          ({"per_node": 3}, "per_node"),
                                          ({"compute_s": -1.0}, "compute_s"),
                                          ({"methods": ["nope"]}, "methods"),
                                          ({"optimizer": "lamb"}, "optimizer")])
def test_bad_arguments_name_themselves(kwargs, name):
  args = {"gbps": 1.0, "workers": 8, "compute_s": 0.01, **kwargs}
  with pytest.raises(ValueError, match=name):
    jaxcomp.advise(TREE, **args)


def test_cli_prints_ranked_tables_and_draws_one_labelled_figure(tmp_path, capsys):
  kernels = tmp_path / "k.json"  # a device's own kernel table (`kernels --json`), one case
  kernels.write_text(json.dumps({"cases": [
      {"method": "none", "case": "c", "seconds": 1e-3, "values": 1000},
      {"method": "topk", "case": "c", "seconds": 3e-3, "values": 1000}]}))
  panels = adv.main(["--model", "resnet50", "--methods", "none,fp16,topk", "--gbps", "1,100",
                     "--kernels", str(kernels), "--out", str(tmp_path)])
  out = capsys.readouterr().out
  assert "resnet50 at 1 Gb/s" in out and "resnet50 at 100 Gb/s" in out and "`diloco H=64`" in out
  assert (tmp_path / "advise_resnet50.png").stat().st_size > 10_000
  rows = dict(panels)["resnet50, 8 workers at 1 Gb/s"]
  topk = next(r for r in rows if r.method == "topk")
  assert topk.compression == pytest.approx(2e-6 * 25_557_032)  # 2 us per 1000 values, scaled
