"""One budget for a batch's rows: the rows' auto planners agree on a common tree size and depth.

In a batch, one target forward verifies [B, N_max] nodes and one draft forward serves each round of
expansions: a row's tree costs the batch its *largest* tree and its *deepest* drafting, not the sum
of what each row asked for. A row planning alone (even with the batched step's cost curves, whose
price per node is right when every row does the same) cannot see that: with 16 rows, the few rows
that want 48 nodes and 20 levels set the step for all (measured: `docs/bench/batch-default-pair`).

So the rows' planners share one ``BatchBudget``. After every step each row reports what it planned
(n nodes, depth) and whether the budget stopped it; the next step's caps are the MEDIAN of the rows'
wishes (a row stopped by a cap wishes a quarter more than it got, so the caps can grow back): half
the rows get all they want, and no row's outlier sets the step. Rows decoding plainly (off) do not
vote. Like every planning decision it changes tree shapes, never tokens.
"""

from __future__ import annotations

import math
from statistics import median


class BatchBudget:
    def __init__(self) -> None:
        self.wishes: dict[int, tuple[int, int]] = {}  # row -> (nodes, depth) it wanted at its last step

    def report(self, row: int, n: int, depth: int, caps: tuple[int | None, int | None]) -> None:
        """Row ``row`` planned ``n`` nodes of ``depth`` under ``caps``; n = 0: it decodes plainly."""
        if n <= 0:
            self.wishes.pop(row, None)
            return
        cap_n, cap_d = caps
        want_n = n + n // 4 + 1 if cap_n is not None and n >= cap_n else n
        want_d = depth + depth // 4 + 1 if cap_d is not None and depth >= cap_d else depth
        self.wishes[row] = (want_n, want_d)

    @property
    def caps(self) -> tuple[int | None, int | None]:
        """The caps a row's next step plans under: the medians of the speculating rows' latest wishes
        (None: no cap, e.g. before any row has planned)."""
        if not self.wishes:
            return (None, None)
        return (math.ceil(median(w[0] for w in self.wishes.values())),
                math.ceil(median(w[1] for w in self.wishes.values())))
