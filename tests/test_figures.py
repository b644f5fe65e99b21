"""The benchmarks' figures: every point labelled, no two labels on top of each other, no colour reused."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from jaxcomp_bench.common import colours, frontier, label_points  # noqa: E402


def test_labels_cover_every_point_and_never_overlap():
  points = [("dense f32", 100.0, 97.5), ("fp16", 50.0, 97.3), ("bf16", 50.5, 97.3), ("qsgd", 25.0, 97.4),
            ("natural", 25.2, 97.4), ("u8bit", 25.4, 97.41), ("topk", 1.0, 97.6), ("dgc", 1.1, 97.55),
            ("sbc", 1.2, 97.0), ("redsync", 1.05, 93.6)]
  fig, ax = plt.subplots(figsize=(6, 4))
  ax.scatter([p[1] for p in points], [p[2] for p in points])
  ax.set_xscale("log")
  label_points(ax, points)
  renderer = fig.canvas.get_renderer()
  notes = [c for c in ax.get_children() if isinstance(c, matplotlib.text.Annotation)]
  named = ", ".join(n.get_text() for n in notes).split(", ")
  assert sorted(named) == sorted(p[0] for p in points)  # each once; near-equal points share a label
  boxes = [Text.get_window_extent(n, renderer) for n in notes]
  assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
  plt.close(fig)


def test_frontier_and_colours():
  pts = [("a", 1.0, 90.0), ("b", 2.0, 95.0), ("c", 3.0, 94.0), ("d", 4.0, 99.0), ("e", 1.5, 80.0)]
  assert [p[0] for p in frontier(pts)] == ["a", "b", "d"]
  assert [p[0] for p in frontier(pts, higher_is_better=False)] == ["a", "e"]
  c = colours([f"m{i}" for i in range(25)])
  assert len({tuple(v) for v in c.values()}) == 25
