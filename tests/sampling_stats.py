"""Helpers of the sampling exactness tests: exact next-token tables by enumeration, the emitted
tokens of batched verifications, and a chi-square goodness-of-fit test.

The statistics (also in docs/sampling.md): n seeded trials give counts over the V^L possible first L
tokens; cells whose expected count n·p is below 5 are pooled into one cell (Cochran's rule; if the
pool itself expects < 5 it joins the smallest other cell). Pearson's X² = Σ (obs − exp)² / exp has,
for an exact sampler, approximately a χ² distribution with (cells − 1) degrees of freedom, and the
p-value is the regularised upper incomplete gamma Q(df/2, X²/2) (``torch.special.gammaincc``). A test
fails when p < ALPHA = 1e-6: an exact sampler fails such a check with probability 1e-6 per test, and
the seeds are fixed, so the suite is deterministic. Outcomes of probability exactly 0 (e.g. a token
that top-k removed) must never occur at all.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

ALPHA = 1e-6


@dataclass
class Tables:
    """``rows[l]``: [V^l, V] the model's (processed) next-token distribution after PROMPT + s, for every
    s of l tokens (index: s read as a base-V number, first token most significant)."""

    rows: list[torch.Tensor]
    vocab: int

    @classmethod
    def build(cls, model, prompt: list[int], levels: int, probs_fn) -> Tables:
        v = model.config.vocab_size
        rows = []
        for length in range(levels):
            pre = torch.tensor(list(itertools.product(range(v), repeat=length)), dtype=torch.long).reshape(
                v**length, length
            )
            ids = torch.cat([torch.tensor(prompt).expand(v**length, len(prompt)), pre], dim=1)
            with torch.inference_mode():
                logits = model(ids).logits[:, -1]  # [V^l, V]
            rows.append(probs_fn(logits).to(torch.float64))
        return cls(rows, v)

    def at(self, seqs: torch.Tensor) -> torch.Tensor:
        """[..., V] the distribution after each sequence [..., l] (all of one length l)."""
        length = seqs.shape[-1]
        return self.rows[length][index(seqs, self.vocab)]

    def joint(self, length: int) -> torch.Tensor:
        """[V^length] the exact probability of every sequence of the first ``length`` tokens."""
        p = torch.ones(1, dtype=torch.float64)
        for level in range(length):
            p = (p[:, None] * self.rows[level]).reshape(-1)
        return p


def index(seqs: torch.Tensor, v: int) -> torch.Tensor:
    """Base-v number of each row of ``seqs`` [..., l] (0 for l = 0)."""
    out = torch.zeros(seqs.shape[:-1], dtype=torch.long)
    for j in range(seqs.shape[-1]):
        out = out * v + seqs[..., j]
    return out


def path_table(tt) -> torch.Tensor:
    """[N, D+1]: column d holds the id of the depth-d node on the path to each node (the node itself
    at its own depth; 0 beyond it)."""
    anc, depths = tt.ancestors, tt.depths
    n, dmax = anc.shape[0], int(depths.max())
    out = torch.zeros(n, dmax + 1, dtype=torch.long)
    for d in range(dmax + 1):
        hit = anc & (depths[None, :] == d)  # [N, N] the ancestor at depth d
        out[:, d] = torch.where(hit.any(1), hit.float().argmax(1), 0)
    return out


def emitted(tt, tokens: torch.Tensor, best: torch.Tensor, bonus: torch.Tensor, length: int) -> torch.Tensor:
    """[B, length]: the accepted tokens then the bonus token of every trial, -1 after them."""
    b = tokens.shape[0]
    paths = path_table(tt)[best]  # [B, D+1]
    depth = tt.depths[best]  # [B]
    out = torch.full((b, length), -1, dtype=torch.long)
    rows = torch.arange(b)
    for pos in range(length):
        if pos + 1 < paths.shape[1]:
            tok = tokens[rows, paths[:, pos + 1]]
            out[:, pos] = torch.where(pos < depth, tok, out[:, pos])
        out[:, pos] = torch.where(depth == pos, bonus, out[:, pos])
    return out


def complete(seqs: torch.Tensor, tables: Tables, generator: torch.Generator) -> torch.Tensor:
    """Fill the -1 tail of every row by sampling from the target's exact conditionals (what the next
    decoding steps would do if they are exact too), position by position."""
    from treespec.sampling import sample_rows

    out = seqs.clone()
    for pos in range(out.shape[1]):
        todo = out[:, pos] < 0
        if bool(todo.any()):
            rows = tables.at(out[todo, :pos])
            out[todo, pos] = sample_rows(rows, generator)
    return out


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, float, int]:
    """Pearson's goodness of fit of ``samples`` (cell indices [n]) to ``probs`` [K]: (X², df, p-value,
    observations in cells of probability 0)."""
    n = samples.numel()
    obs = torch.bincount(samples, minlength=probs.numel()).to(torch.float64)
    impossible = int(obs[probs <= 0].sum())
    exp = n * probs
    big = exp >= 5
    o, e = list(obs[big]), list(exp[big])
    po, pe = float(obs[~big].sum()), float(exp[~big].sum())
    if pe > 0:
        if pe >= 5 or not e:
            o.append(po)
            e.append(pe)
        else:
            j = min(range(len(e)), key=lambda i: e[i])
            o[j] += po
            e[j] += pe
    o_t, e_t = torch.tensor(o, dtype=torch.float64), torch.tensor(e, dtype=torch.float64)
    stat = float(((o_t - e_t) ** 2 / e_t).sum())
    df = max(len(e) - 1, 1)
    pvalue = float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )
    return stat, df, pvalue, impossible


def fit(seqs: torch.Tensor, tables: Tables) -> tuple[float, int, float, int]:
    """Chi-square of complete sequences [n, L] against the exact joint of the first L tokens."""
    length = seqs.shape[1]
    return chi_square(index(seqs, tables.vocab), tables.joint(length))


def assert_exact(seqs: torch.Tensor, tables: Tables, what: str) -> float:
    stat, df, pvalue, impossible = fit(seqs, tables)
    assert impossible == 0, f"{what}: {impossible} samples of probability-0 sequences"
    assert pvalue >= ALPHA, (
        f"{what}: X² = {stat:.1f} on {df} df, p = {pvalue:.3g} < {ALPHA} over {seqs.shape[0]} trials"
    )
    return pvalue
