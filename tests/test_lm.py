"""The transformer language-model task (jaxcomp_bench.lm): data, model, training under pmap, the CLI.

Few steps and few compiled programs: the whole module runs in about a minute on 2 busy cores.
"""

import json
import math
import os

import jax
import numpy as np
import pytest

import jaxcomp
from jaxcomp_bench import lm

N = 8


def test_data_is_deterministic_and_split_90_10():
  c = lm.load()
  assert c.vocab == "".join(sorted(set(c.text)))
  assert c.vocab_size == len(set(c.text)) > 80  # English prose, code and punctuation
  assert len(c.train) + len(c.held_out) == len(c.text)
  assert len(c.train) == int(0.9 * len(c.text))
  assert c.decode(c.train[:200]) == c.text[:200]
  np.testing.assert_array_equal(c.encode(c.text[:200]), c.train[:200])
  assert c.decode(c.held_out[-200:]) == c.text[-200:]
  assert c.train.dtype == np.int32 and 0 <= c.train.min() and c.train.max() < c.vocab_size
  # training windows: a fixed function of (seed, step), within the text, targets shifted by one
  s = lm.train_starts(len(c.train), 5, N, 4, seed=0)
  assert s.shape == (N, 4)
  np.testing.assert_array_equal(s, lm.train_starts(len(c.train), 5, N, 4, seed=0))
  assert not np.array_equal(s, lm.train_starts(len(c.train), 6, N, 4, seed=0))
  assert not np.array_equal(s, lm.train_starts(len(c.train), 5, N, 4, seed=1))
  many = lm.train_starts(len(c.train), 0, N, 4096, seed=3)
  assert many.min() >= 0 and many.max() <= len(c.train) - lm.CONTEXT - 1
  x, y = next(lm.batches(c, 1, N, 4, seed=0))
  assert x.shape == y.shape == (N, 4, lm.CONTEXT)
  np.testing.assert_array_equal(x[..., 1:], y[..., :-1])
  h = lm.held_out_starts(len(c.held_out))
  assert h.shape == (lm.EVAL_WINDOWS,) and h.min() == 0 and h.max() == len(c.held_out) - lm.CONTEXT - 1
  with pytest.raises(ValueError, match="starts must be in"):
    lm.windows(c.held_out, np.array([len(c.held_out) - lm.CONTEXT]))


def test_model_shapes_and_initial_loss():
  c = lm.load()
  model = lm.Transformer(c.vocab_size)
  params = lm.init_params(model, seed=0)
  leaves = jax.tree.leaves(params)
  assert len(leaves) == 38  # 2 embeddings, 2 x 16 per block, final LayerNorm (2), output (2)
  v, w = c.vocab_size, lm.WIDTH
  block = 4 * w + 4 * (w * w + w) + (w * lm.MLP + lm.MLP) + (lm.MLP * w + w)  # LNs, attention, MLP
  assert lm.num_params(params) == v * w + lm.CONTEXT * w + 2 * block + 2 * w + (w * v + v)
  x, y = lm.windows(c.train, np.array([0, 1000, 5000]))
  apply = jax.jit(model.apply)  # eager flax is slow
  logits = apply({"params": params}, x)
  assert logits.shape == (3, lm.CONTEXT, c.vocab_size)
  loss = float(lm.loss_fn(params, model, x, y))
  assert abs(loss - math.log(c.vocab_size)) < 0.15
  # causal: changing the last input leaves every earlier position's logits unchanged
  x2 = x.copy()
  x2[:, -1] = (x2[:, -1] + 1) % c.vocab_size
  np.testing.assert_allclose(apply({"params": params}, x2)[:, :-1], logits[:, :-1], atol=1e-5)


def test_dense_training_lowers_the_held_out_loss():
  r = lm.train("none", steps=30, chain="default", batch=8)
  assert not r.error, r.error
  c = lm.load()
  start = lm.held_out_loss(lm.init_params(lm.Transformer(c.vocab_size)), lm.Transformer(c.vocab_size), c)
  assert r.held_out_loss < start - 0.8, (start, r.held_out_loss)
  assert r.replicas_equal
  n = lm.num_params(lm.init_params(lm.Transformer(c.vocab_size)))
  assert r.wire_bytes == r.nominal_bytes >= 4 * n  # one float32 all-reduce of every gradient
  assert r.curve[0][0] == 1 and r.curve[-1][0] == 30


def test_compressed_method_under_pmap_keeps_replicas_identical():
  r = lm.train("topk", steps=3, chain="default", batch=4)
  assert not r.error, r.error
  assert math.isfinite(r.held_out_loss) and math.isfinite(r.final_train_loss)
  assert r.replicas_equal  # every worker's parameters bit-identical after 3 steps
  assert 0 < r.wire_bytes < 4 * lm.num_params(lm.init_params(lm.Transformer(lm.load().vocab_size))) / 10


def test_unknown_names_and_bad_arguments_are_clear_errors():
  with pytest.raises(ValueError, match=r"name must be one of .* got name='nope'"):
    lm.train("nope", chain="default")
  with pytest.raises(ValueError, match=r"only with chain='recipe'"):
    lm.train("onebit_adam", chain="default")
  with pytest.raises(ValueError, match=r"chain must be one of \('recipe', 'default'\)"):
    lm.train("none", chain="sgd")
  with pytest.raises(ValueError, match="steps must be an int >= 1"):
    lm.train("none", steps=0, chain="default")
  with pytest.raises(SystemExit, match="unknown"):
    lm.runs("none,nope", "default")
  with pytest.raises(SystemExit, match="--chain recipe"):
    lm.runs("demo", "default")
  assert lm.runs("topk,none", "both") == [("none", "recipe"), ("topk", "recipe"),
                                          ("none", "default"), ("topk", "default")]
  full = lm.runs("all", "both")
  assert full[0] == ("none", "recipe") and ("demo", "recipe") in full and ("demo", "default") not in full
  assert len(full) == 2 * len(jaxcomp.METHODS) + len(lm.RECIPE_ONLY)


def test_cli_end_to_end(tmp_path, capsys):
  out = str(tmp_path / "tmp")
  results = lm.main(["--steps", "2", "--methods", "none,topk", "--chain", "default", "--no-progress",
                     "--out", out])
  assert [(r.method, r.chain) for r in results] == [("none", "default"), ("topk", "default")]
  assert all(not r.error for r in results), [r.error for r in results]
  for f in ("results.json", "results.md", "loss_vs_bytes.png"):
    assert os.path.getsize(os.path.join(out, f)) > 0
  with open(os.path.join(out, "results.json")) as f:
    saved = json.load(f)
  assert saved["meta"]["steps"] == 2 and saved["meta"]["leaves"] == 38
  assert [r["method"] for r in saved["results"]] == ["none", "topk"]
  text = capsys.readouterr().out
  assert "| method" in text and "held-out loss" in text and "topk" in text
  md = open(os.path.join(out, "results.md")).read()
  assert "vs dense bytes (x)" in md and "speed-up 8w@1G" in md


@pytest.mark.slow
def test_diloco_cli_end_to_end(tmp_path):
  """``lm --diloco``: dp and Streaming DiLoCo (P = 2, fp4) for 4 steps, H = 2: both train, the sync's
  compiled bytes equal jaxcomp.wire_bytes per fragment, bytes per step average a period's, the anchor
  is shared; the table, the targets and the figure are written."""
  out = str(tmp_path / "diloco")
  runs = lm.main(["--diloco", "--steps", "4", "--sync-every", "2", "--fragments", "2", "--configs",
                  "streaming-fp4", "--no-progress", "--out", out])
  assert [r.config for r in runs] == ["dp", "streaming-fp4"] and not any(r.error for r in runs)
  dp, st = runs
  assert dp.mean_bytes == dp.peak_bytes == jaxcomp.wire_bytes(jaxcomp.none(axis_name="data"), lm.init_params(
      lm.Transformer(lm.load().vocab_size), 0))
  assert st.hlo_bytes == st.nominal_bytes and len(st.nominal_bytes) == 2
  assert st.mean_bytes == sum(st.nominal_bytes) / 2 and st.peak_bytes == max(st.nominal_bytes)
  assert st.anchor_shared and math.isfinite(st.held_out_loss) and st.held_out_loss < 4.6  # ln(103) = 4.63
  md = open(os.path.join(out, "results.md")).read()
  assert "| streaming-fp4" in md and "peak B/sync" in md and "targets:" in md
  assert os.path.getsize(os.path.join(out, "loss_vs_bytes.png")) > 0
