"""How many drafts each request verifies in its next step: as many, over the batch, as make the step's
tokens per second highest.

A step of M rows (every scheduled token, drafts included) takes about a + b * padded(M) (StepCost,
measured on the engine's own steps). padded is where the linears' kernels round rows up: a GEMM computes
activations a block of rows at a time (16 on the AVX512-BF16 and AMX tiles: 17 rows cost what 32
do), so the first draft past a block boundary costs a block, and the drafts after it nearly
nothing. A request's j-th draft yields a token with probability alpha^j (alpha: its per-draft
acceptance; every draft before it must be accepted too). The step's R decoding requests make R
tokens plus the drafts' expected ones; draft_budgets takes the drafts with the best odds first and
stops at the count whose tokens per second are highest. Proposing costs too: a draft model runs one
forward per draft deep, timed by the worker (ModelRunnerOutput.draft_seconds) and priced per pass.

On a memory-bound step (a big model, few requests) b is small against a: every draft is worth it.
On a compute-bound one (a small model, many requests) only drafts that fill a block already paid
for, or well-accepted ones, are. a and b come from the engine's whole decode steps (scheduling and
output included: they are a step's fixed cost), fitted by least squares with older steps weighing
less; alpha from the request's own drafts, starting from the engine's. A fit needs steps of
different sizes, and a request given no drafts needs a draft now and then for its estimate to
recover when its text turns predictable: one step in EXPLORE_EVERY gives every request a draft,
another gives none. Pure bookkeeping, no torch (core/).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dabba.core.request import Request

DECAY = 0.98  # weight of a step in the fit, per step since
SIZE_MEAN = 0.2  # weight of a step's time in its size's recent mean
STALE_STEPS = 64  # a size's mean unrefreshed for this many steps gives way to the fit (and is tried again)
PRIOR_DRAFTS = 4  # a request's acceptance starts as the engine's, worth this many verified drafts
EXPLORE_EVERY = 16  # steps between those where every request verifies a draft (and between those with none)


@dataclass(frozen=True)
class RowBlocks:
    """How the linears' kernels group a step's rows: up to exact_rows each row costs its own (a
    GEMV), beyond them rows are computed block at a time (the worker knows its kernels; block 1:
    no blocking)."""

    exact_rows: int = 0
    block: int = 1

    def padded(self, rows: int) -> int:
        if rows <= self.exact_rows or self.block <= 1:
            return rows
        return -(-rows // self.block) * self.block


@dataclass
class StepCost:
    """A decode step's time by its padded rows: the recent mean of the steps of that size, else a +
    b * padded(rows) by exponentially weighted least squares over all sizes. Kernels run more
    rows at a better rate per row, so the line is too flat near a batch's own size, where drafts
    are decided: the measured sizes correct it. A size's mean left unmeasured for STALE_STEPS
    steps gives way to the line again, so that one unlucky step does not rule a size out for
    good. The scheduler records decode steps only, and not the one right after a prefill: a
    prefill's attention costs more per token, and the step after it runs on swept caches."""

    rows: RowBlocks = field(default_factory=RowBlocks)
    by_size: dict[int, tuple[float, int]] = field(default_factory=dict)  # padded rows -> (recent mean s, step)
    steps: int = 0  # decode steps recorded
    pass_seconds: float = 0.0  # recent mean time of a proposer's pass (one draft for every request asked)
    w: float = 0.0  # sum of weights
    n: float = 0.0  # weighted sums of padded rows, rows^2, seconds, rows * seconds
    nn: float = 0.0
    t: float = 0.0
    nt: float = 0.0

    def record(self, num_rows: int, seconds: float) -> None:
        n = self.rows.padded(num_rows)
        self.steps += 1
        mean = seconds if n not in self.by_size else SIZE_MEAN * seconds + (1 - SIZE_MEAN) * self.by_size[n][0]
        self.by_size[n] = mean, self.steps
        self.w, self.n, self.nn, self.t, self.nt = (DECAY * self.w + 1, DECAY * self.n + n, DECAY * self.nn + n * n,
                                                    DECAY * self.t + seconds, DECAY * self.nt + n * seconds)

    def record_drafting(self, passes: int, seconds: float) -> None:
        """A step's proposing: ``passes`` drafts deep (a draft model runs one forward a pass)."""
        if passes > 0:
            self.pass_seconds = seconds / passes if not self.pass_seconds else (
                SIZE_MEAN * seconds / passes + (1 - SIZE_MEAN) * self.pass_seconds)

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None until steps of different padded sizes have been seen."""
        spread = self.w * self.nn - self.n ** 2
        if self.w < 2 or spread <= 1e-9 * max(self.w * self.nn, 1.0):
            return None
        b = max((self.w * self.nt - self.n * self.t) / spread, 0.0)
        return max((self.t - b * self.n) / self.w, 0.0), b

    def measured(self, num_rows: int) -> bool:
        """Whether steps of this padded size were timed within the last STALE_STEPS steps."""
        return self.steps - self.by_size.get(self.rows.padded(num_rows), (0.0, -STALE_STEPS))[1] < STALE_STEPS

    def seconds(self, fitted: tuple[float, float], num_rows: int) -> float:
        """A decode step's expected time at this many rows."""
        if self.measured(num_rows):
            return self.by_size[self.rows.padded(num_rows)][0]
        a, b = fitted
        n = self.rows.padded(num_rows)
        return a + b * n


def draft_budgets(cost: StepCost, base_rows: int, acceptance: dict[str, float], most: int) -> dict[str, int]:
    """How many drafts (up to ``most``) each request in ``acceptance`` verifies next step, in a step
    of ``base_rows`` rows without them: the count over the batch whose expected tokens per second
    are highest, the drafts most likely accepted first. A step's time is its rows' plus the
    proposer's passes, as deep as the deepest request's drafts. Every draft before a fit exists."""
    fitted = cost.fit()
    if fitted is None or cost.seconds(fitted, base_rows) <= 0.0:
        return dict.fromkeys(acceptance, most)
    odds = sorted(((alpha ** j, j, rid) for rid, alpha in acceptance.items() for j in range(1, most + 1)
                   if alpha > 0.0), reverse=True)
    tokens, depth = float(len(acceptance)), 0
    best_rate, best = tokens / cost.seconds(fitted, base_rows), 0
    for count, (p, j, _) in enumerate(odds, 1):
        tokens, depth = tokens + p, max(depth, j)
        rate = tokens / (cost.seconds(fitted, base_rows + count) + depth * cost.pass_seconds)
        if rate > best_rate:
            best_rate, best = rate, count
    budgets = dict.fromkeys(acceptance, 0)
    for _, _, rid in odds[:best]:
        budgets[rid] += 1
    return budgets


def engine_acceptance(accepted: int, rejected: int) -> float:
    """Per-draft acceptance over every request, as if one more draft had been accepted (1 before
    any draft: worth a try; never 0 after the first rejection)."""
    return (accepted + 1) / (accepted + rejected + 1)


def request_acceptance(accepted: int, rejected: int, engine_acceptance: float) -> float:
    """Per-draft acceptance of one request: drafts accepted over those verified (a step's drafts
    after its first rejection were never verified), starting from the engine's."""
    return (accepted + PRIOR_DRAFTS * engine_acceptance) / (accepted + rejected + PRIOR_DRAFTS)


def lookahead_slots(num_lookahead_tokens: int, request: Request, end: int, max_model_len: int) -> int:
    """KV slots past a step's tokens (which end at position ``end``) that the proposer writes (a
    draft model's own KV for the tokens it proposes from), within the prompt + max_tokens - 1 slots
    admission reserved (the last token is never fed), so a request that fits alone still does."""
    slots = min(request.num_prompt_tokens + request.max_tokens, max_model_len) - 1
    return max(0, min(num_lookahead_tokens, slots - end))
