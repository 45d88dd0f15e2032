"""Isotonic regression (pool adjacent violators): the non-decreasing fit used by the planners' models.

The calibration map (``treespec.acceptance_map``) makes acceptance non-decreasing in the draft's
confidence; the cost curves (``treespec.cost``) make seconds non-decreasing in the number of nodes,
so that noise in a few measurements cannot make a larger tree look cheaper than a smaller one.
"""

from __future__ import annotations


def isotonic(values: list[float], weights: list[float]) -> list[float]:
    """Pool adjacent violators: the non-decreasing sequence closest to ``values`` (weighted L2)."""
    blocks: list[list[float]] = []  # [mean, weight, length]
    for v, w in zip(values, weights):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    out: list[float] = []
    for mean, _, n in blocks:
        out += [mean] * int(n)
    return out
