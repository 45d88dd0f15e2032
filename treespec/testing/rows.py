"""The rules one ``expand`` answer must follow, and how two answers are compared and described.

Pure functions: each returns why something is wrong (a message) or ``None``; the driver raises.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from treespec.interfaces import Drafter, Proposals
from treespec.tree import DraftTree


def describe_plugin(kind: str, plugin: Any) -> str:
    """``drafter ClassName(option=value, ...)`` (``kind`` first) with the options that differ from
    the defaults."""
    opts: dict[str, Any] = {}
    try:
        opts = plugin.config.model_dump(exclude_defaults=True)
    except Exception:  # noqa: BLE001, S110 - a plugin without a pydantic config is named without options
        pass
    return f"{kind} {type(plugin).__name__}({', '.join(f'{k}={v!r}' for k, v in opts.items())})"


def describe_drafter(drafter: Drafter) -> str:
    return describe_plugin("drafter", drafter)


def describe_node(tree: DraftTree, node: int) -> str:
    return f"node {node} (depth {int(tree.depths[node])}, path tokens {tree.path_tokens(node)})"


def describe_row(tokens: list[int], q: list[float]) -> str:
    return f"tokens {tokens} q [{', '.join(f'{x:.6g}' for x in q)}]"


def real_columns(q: list[float]) -> int:
    """Columns before the first padding entry (q == 0)."""
    return next((j for j, x in enumerate(q) if x == 0), len(q))


def shape_problem(props: Any, m: int, k: int, vocab: int) -> str | None:
    """Why an answer to ``expand`` of ``m`` nodes with ``k`` is not ``Proposals`` of CPU tensors,
    tokens long and q floating, both ``[m, k]`` (``[m, c]``, ``vocab <= c <= k``, if k > vocab)."""
    tokens, q = getattr(props, "tokens", None), getattr(props, "q", None)
    if not isinstance(props, Proposals) or not isinstance(tokens, torch.Tensor) or not isinstance(q, torch.Tensor):
        return f"returned {type(props).__name__}, not Proposals(tokens=Tensor, q=Tensor)"
    if tokens.dtype != torch.long:
        return f"tokens are {tokens.dtype}, expected torch.long"
    if not q.dtype.is_floating_point:
        return f"q are {q.dtype}, expected a floating dtype"
    if tokens.device.type != "cpu" or q.device.type != "cpu":
        return f"tokens on {tokens.device}, q on {q.device}; return CPU tensors (builders index them on the CPU)"
    lo = min(k, vocab)
    cols = tokens.shape[1] if tokens.dim() == 2 else -1
    if tokens.dim() != 2 or tuple(q.shape) != tuple(tokens.shape) or tokens.shape[0] != m or not lo <= cols <= k:
        want = f"[{m}, {k}]" if lo == k else f"[{m}, c] with {lo} <= c <= {k}"
        return f"tokens {list(tokens.shape)} and q {list(q.shape)}, expected both {want}"
    return None


def row_problem(tokens: list[int], q: list[float], vocab: int) -> str | None:
    """Why one row breaks the rules: q in [0, 1], padding (q == 0) last, best first, distinct
    tokens inside the vocabulary."""
    bad = [x for x in q if not (math.isfinite(x) and 0.0 <= x <= 1.0)]
    if bad:
        return f"q = {bad[0]!r} is not in [0, 1]"
    n = real_columns(q)
    later = next((j for j in range(n, len(q)) if q[j] > 0), None)
    if later is not None:
        return f"padding (q == 0) at column {n} before q > 0 at column {later}; padding goes last"
    up = next((j for j in range(1, n) if q[j] > q[j - 1]), None)
    if up is not None:
        return f"not best first: q[{up}] = {q[up]:.6g} > q[{up - 1}] = {q[up - 1]:.6g}"
    seen: dict[int, int] = {}
    for j, t in enumerate(tokens[:n]):
        if t in seen:
            return f"token {t} proposed twice (columns {seen[t]} and {j}); a node's children must be distinct"
        seen[t] = j
        if not 0 <= t < vocab:
            return f"token {t} at column {j} is outside the target's vocabulary [0, {vocab})"
    return None


def row_mismatch(
    got: tuple[list[int], list[float]], want: tuple[list[int], list[float]], rtol: float, atol: float, exact: bool
) -> str | None:
    """Why two proposal rows differ, or None. Exact: q and the real tokens identical. Tolerant:
    q within rtol/atol; tokens equal as sets within each run of tied q (a tie that reaches the last
    column may be cut differently)."""
    got_tokens, got_q = got
    want_tokens, want_q = want
    if len(got_q) != len(want_q):
        return f"{len(got_q)} columns instead of {len(want_q)}"
    if exact:
        if got_q != want_q:
            j = next(j for j, (a, b) in enumerate(zip(got_q, want_q)) if a != b)
            return (
                f"q differ at column {j} ({got_q[j]!r} vs {want_q[j]!r}); identical calls must give identical proposals"
            )
        n = real_columns(want_q)
        if got_tokens[:n] != want_tokens[:n]:
            j = next(j for j, (a, b) in enumerate(zip(got_tokens[:n], want_tokens[:n])) if a != b)
            return f"tokens differ at column {j}"
        return None
    for j, (a, b) in enumerate(zip(got_q, want_q)):
        if not math.isclose(a, b, rel_tol=rtol, abs_tol=atol):
            return f"q differ at column {j}: {a:.10g} vs {b:.10g} (rtol={rtol:g}, atol={atol:g})"
    n = max(real_columns(got_q), real_columns(want_q))
    start = 0
    while start < n:
        end = start + 1  # [start, end) is one run of tied q
        while end < n and math.isclose(want_q[end], want_q[end - 1], rel_tol=rtol, abs_tol=atol):
            end += 1
        if set(got_tokens[start:end]) != set(want_tokens[start:end]) and end < len(want_q):
            return f"tokens differ in columns {start}..{end - 1}, where q are not tied"
        start = end
    return None


def unproposed_token(props: Proposals, row: int, vocab: int, salt: int) -> int:
    """A token the drafter did not propose in ``row`` (avoiding ids 0-2, often special)."""
    proposed = set(props.tokens[row][props.q[row] > 0].tolist())
    span = max(vocab - 3, 1)
    start = (17 * salt + 5) % span
    for i in range(vocab):
        token = 3 + (start + i) % span
        if token not in proposed:
            return token
    return 0


def row(props: Proposals, i: int) -> Proposals:
    """Row ``i`` of an answer, as an answer for one node."""
    return Proposals(tokens=props.tokens[i : i + 1], q=props.q[i : i + 1])
