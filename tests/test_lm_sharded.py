"""python -m jaxcomp.bench lm --mesh: the LM task on a sharded model equals the replicated one (dense)."""

import jax
import numpy as np
import pytest

import jaxcomp
from jaxcomp_bench import lm_sharded
from jaxcomp_bench.transformer import Transformer, init_params, load


@pytest.mark.slow
def test_none_sharded_equals_replicated_over_20_lm_steps():
  mesh = lm_sharded.mesh_of("dcn=2,fsdp=4")
  corpus = load()
  model = Transformer(corpus.vocab_size)
  specs = lm_sharded.specs_for(init_params(model, 0), 4, "fsdp")
  assert sum(s != jax.sharding.PartitionSpec(*([None] * len(s))) for s in jax.tree.leaves(specs)) > 5
  tx = jaxcomp.recipe("none", 3e-3, axis_name="dcn", optimizer="adamw")
  params, loss, hlo, flops, state = lm_sharded._run(model, corpus, tx, mesh, 20, 0, specs)
  rep = jaxcomp.recipe("none", 3e-3, axis_name=("dcn", "fsdp"), optimizer="adamw")
  rep_params, rep_loss, _, rep_flops, rep_state = lm_sharded._run(model, corpus, rep, mesh, 20, 0)
  np.testing.assert_allclose(loss, rep_loss, rtol=1e-5)
  # AdamW divides by sqrt(nu): where a gradient is rounding noise (a LayerNorm bias early on), the
  # two reduction orders (reduce-scatter over fsdp, then dcn; one all-reduce) move it by up to
  # ~1e-5 differently per step; the loss, the target, agrees to 1e-5.
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(rep_params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=2e-4)
  assert state <= 0.3 * rep_state  # AdamW's moments and jaxcomp's state: a device's shards
  assert flops <= 1.3 * rep_flops
