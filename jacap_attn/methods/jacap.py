"""Jacap: ridge leverage of softmax-aware capacity features (docs/method.md#jacap-scores)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..math import carry as carrying, lookup, scoring
from ..math.budget import free_budget
from ..math.carry import PART, UNITS
from ..types import fold_plans, repeat_rows, unfold_scores
from .base import Method, PrefillInputs, option, register

LOOKUP = lookup.PART
LAST = "last_query"  # the plan part of carry_by="last": [b, h, n] attention of the window's last query


@register("jacap")
@dataclass(frozen=True)
class Jacap(Method):
    """Jacobian-information-capacity selection (Jacap, arXiv:2609.08131, abstract; our
    reconstruction in docs/method.md). Per KV head, tokens rank by the ridge leverage of
    ``phi_i = sqrt(omega_i) (v_i - vbar)`` (docs/method.md#ridge-leverage-scores), ``omega`` the
    softmax-aware importance weights of the window queries (docs/method.md#importance-weights),
    mixed with the attention-mass share (docs/method.md#attention-mass-term); then, across layers,
    consensus tokens and attention sinks are kept (docs/method.md#cross-layer-consensus).

    Options: ``ridge`` rho (lambda = rho tr(Phi^T Phi)/d); ``beta`` weight of the first-order
    softmax-sensitivity term; ``pooling``/``kernel`` smoothing of omega along the sequence;
    ``selector`` ``"leverage"`` or ``"greedy"`` (exact greedy log-det, eager only); ``consensus``
    share of each head's budget beyond the window given to cross-layer consensus tokens, with
    forward max-pooling ``consensus_kernel``; ``mass`` gamma of the attention-mass term (0: leverage
    alone); ``sinks`` first real tokens kept in every head; ``units`` (``"none"``, ``"clauses"``, ``"sentences"``,
    ``"chunks"``: :mod:`jacap_attn.selection.units`) of at most ``unit_len`` tokens, to which the consensus is
    carried forward (instead of ``consensus_kernel`` tokens), and along which ``carry`` (gamma in
    [0, 1], 0: off) carries each head's ranking, ``c(t) = max(s(t), gamma c(t-1))``, from the head's
    best ``carry_top`` share of its free budget only (1: from every token) and, with ``carry_peak`` > 0,
    from its outliers only (a score at least ``carry_peak`` times the head's mean), with
    ``carry_count`` > 0 from its ``carry_count`` best tokens only (outside the window and the sinks),
    over runs of at most ``carry_len`` tokens, the source included (a value's first token is enough
    where words are kept whole, D8); with ``units="none"`` the carry is bounded by ``carry_len`` alone.
    With ``carry_by="last"`` and ``carry_force`` > 0, a lender whose last-query attention is at least
    ``carry_force`` keeps its run by force (above the consensus, the strongest lender first), in at most
    ``carry_force_share`` of the head's free budget.

    Carry by default (since 2026-12-05): each head's 16 tokens the window's last query reads most lend
    their score to the 7 tokens after them (``carry=1.0, carry_len=8, carry_count=16, carry_by="last"``;
    ``carry=0`` turns it off, as before).

    Prompt lookup by default (since 2026-12-05; docs/method.md#d12-prompt-lookup): the prompt's runs of at
    least ``lookup`` tokens that repeat a run of the window, specific to one position (``lookup_count``), are kept
    by force with the ``lookup_len`` tokens after them, in at most ``lookup_share`` of a head's free budget,
    in every head whose free budget is at least ``lookup_free`` tokens (24 since 2026-12-06; ``lookup=0``: off).

    Spans: words of up to ``max_span`` tokens kept whole by default (``default_spans``; ``"none"``
    until 2026-12-01, docs/method.md#d8-answers-kept-whole).

    Budget: the ``global`` policy by default (``default_budget``; ``uniform`` until 2026-12-01): one
    ranking of the observation attention across layers and KV heads (docs/results.md#budget-policies).

    Under ``queries="repeat"`` the weights ``omega`` and the attention mass come from the repeat
    pass's queries instead of the window's (docs/method.md#question-agnostic-scoring).
    """

    ridge: float = option(0.1, above=0.0)
    beta: float = option(0.0, low=0.0)  # 1.0 until 2026-12-01 (docs/method.md#defaults-re-tuned-2026-12-01)
    pooling: str = option("avg", choices=scoring.POOLINGS)
    kernel: int = option(3, low=1, odd=True)  # 7 until 2026-12-01
    selector: str = option("leverage", choices=("leverage", "greedy"))
    # 0.25 until the second re-tune of 2026-12-01, 0.5 before 2026-11-30
    # (docs/method.md#consensus-share-re-tuned-2026-12-01)
    consensus: float = option(0.5, low=0.0, high=1.0)
    consensus_kernel: int = option(15, low=1, odd=True)
    mass: float = option(2.0, low=0.0)
    sinks: int = option(4, low=0)
    # Units larger than a word (issue 34, options; docs/method.md#d9-clause-units-for-the-consensus and
    # #d10-scores-carried-along-a-unit): the consensus carried to the end of its unit instead of
    # `consensus_kernel` tokens; `carry` > 0 also carries each head's ranking along its unit.
    units: str = option("none", choices=UNITS)
    unit_len: int = option(64, low=1)
    # The carry's defaults since 2026-12-05 (0, 64, 0, "score" before: off), by the rule of 2026-12-03
    # (docs/method.md#d10-scores-carried-along-a-unit: the lenders ranked by the last window query).
    carry: float = option(1.0, low=0.0, high=1.0)
    carry_top: float = option(1.0, above=0.0, high=1.0)
    carry_len: int = option(8, low=1)
    carry_peak: float = option(0.0, low=0.0)
    carry_count: int = option(16, low=0)
    # What ranks the lending tokens of `carry_count`: the head's score ("score"), or the attention of the
    # window's last query ("last": the token the answer position reads, the asked key in a retrieval head).
    carry_by: str = option("last", choices=("score", "last"))
    # A lending token that the window's last query reads with at least this attention (a probability,
    # GQA mean; 0: off) keeps its run by force, above the consensus (issue 34, an option).
    carry_force: float = option(0.0, low=0.0, high=1.0)
    # At most this share of a head's free budget (beyond its window and sinks) is forced so (1: no cap).
    carry_force_share: float = option(1.0, above=0.0, high=1.0)
    # The global budget's score carried as the ranking is (the same lenders, reach and gamma), so that a
    # head the carry gives a run also gets the budget for it (issue 34, an option; False: off).
    carry_budget: bool = option(False, choices=(False, True))
    # Under carry_budget, only lenders the window's last query reads with at least this attention lend (0: all).
    carry_budget_min: float = option(0.0, low=0.0, high=1.0)
    # Prompt lookup (issue 34; docs/method.md#d12-prompt-lookup; on since 2026-12-05 by its rule, before
    # `lookup=0`, off): a run of at least `lookup` tokens that repeats a run of the observation window token
    # for token is kept by force with the `lookup_len` tokens after it, the longest first, in at most
    # `lookup_share` of a head's free budget (0: off); with `lookup_count` > 0 only where at most that many
    # runs of the prompt share the window run's longest match.
    lookup: int = option(4, low=0)
    lookup_count: int = option(1, low=0)
    lookup_len: int = option(24, low=0)
    lookup_share: float = option(0.35, above=0.0, high=1.0)
    # A head whose free budget is below `lookup_free` tokens forces no run (0: every head forces; 24 since
    # 2026-12-06 by its rule, before 0): it cannot hold a run's end with the value after it, and a part of the
    # run displaces the value its own ranking keeps.
    lookup_free: int = option(24, low=0)
    # A chunked prefill given its whole prompt: its cuts before the last read prompt lookup from the prompt's
    # own last `window` tokens (its question, when it ends the prompt), which they have not reached yet
    # (issue 33, docs/method.md#lookup-ahead-in-a-chunked-prefill; True since 2026-12-06 by its rule, before
    # False: those cuts read no lookup).
    lookup_ahead: bool = option(True, choices=(False, True))
    # Under lookup_ahead, a cut before the last holds the runs it looks up (with the tokens after them) beyond
    # its running budget, within the chunked prefill's bound (issue 33, docs/method.md#lookup-room; False: off;
    # not a default: its rule failed on RULER, 2026-12-06).
    lookup_room: bool = option(False, choices=(False, True))

    needs_window_attention = True
    default_budget = "global"  # "uniform" until 2026-12-01 (eval/results/quality_smollm2_heldout_budget.md)
    # Words kept whole ("none" until the second rule of 2026-12-01; docs/method.md#d8-answers-kept-whole)
    default_spans = "words"
    repeat_stats = ("mass", "sq", "sq_dist")

    def __post_init__(self):
        super().__post_init__()
        if self.carry_budget and not (self.carry > 0 and self.carry_count > 0 and self.units == "none"):
            raise ValueError(f"carry_budget=True carries the global budget's score from the carry's lenders: it needs "
                             f"carry > 0, carry_count > 0 and units='none', got carry={self.carry}, "
                             f"carry_count={self.carry_count}, units={self.units!r}")
        if self.carry_force > 0 and not (self.carry > 0 and self.carry_count > 0 and self.carry_by == "last"):
            raise ValueError(f"carry_force={self.carry_force} forces the runs of the lenders the last window query "
                             f"reads: it needs carry > 0, carry_count > 0 and carry_by='last', got carry={self.carry}, "
                             f"carry_count={self.carry_count}, carry_by={self.carry_by!r}")

    def reads_repeat_stats(self) -> tuple[str, ...]:
        return self.repeat_stats if self.beta else ("mass", "sq")  # beta = 0: no weight on sq_dist

    @property
    def forced_sinks(self) -> int:
        return self.sinks

    @property
    def lookup_slots(self) -> int:
        return self.lookup_free if self.lookup else 0

    @property
    def compilable(self) -> bool:
        return self.selector == "leverage"  # the greedy loop over picks runs eagerly

    @property
    def reads_budget(self) -> bool:
        return self.selector == "greedy"  # the greedy selector picks as many tokens as the budget

    def score_parts(self, inputs: PrefillInputs) -> dict:
        steps = 0
        if self.selector == "greedy":
            # Picks per row: its layer budget (exact for uniform budgets), twice the mean budget for
            # the adaptive ones (beyond it the ranking is the leverage conditional on the picks).
            steps = inputs.budget.to(inputs.keys.device) * (2 if inputs.adaptive else 1) - inputs.window
        if inputs.observed is not None:  # queries="repeat": omega and the mass summed over the repeat pass
            seen = inputs.observed
            omega = seen["sq"]
            if self.beta:  # at beta = 0 the pass does not compute sq_dist (reads_repeat_stats)
                omega = omega + self.beta * inputs.scaling * inputs.scaling * seen["sq_dist"]
            leverage, weights = scoring.jacap_scores_from_weights(
                omega, inputs.values, inputs.key_valid, ridge=self.ridge, pooling=self.pooling, kernel=self.kernel,
                selector=self.selector, steps=steps, window=inputs.window)
            scores = scoring.mix_attention_mass(leverage, seen["mass"], inputs.key_valid, self.mass)
            return {"scores": scores, "leverage": leverage, "weights": weights}
        leverage, weights = scoring.jacap_scores(
            inputs.probs, inputs.keys, inputs.values, inputs.key_valid, scaling=inputs.scaling, beta=self.beta,
            ridge=self.ridge, pooling=self.pooling, kernel=self.kernel, selector=self.selector, steps=steps,
            window=inputs.window)
        scores = scoring.add_attention_mass(leverage, inputs.probs, inputs.key_valid, self.mass)
        # The cross-layer consensus reads the leverage alone; `capacity` budgets read omega.
        parts = {"scores": scores, "leverage": leverage, "weights": weights}
        if self.carry and self.carry_count and self.carry_by == "last":  # [b, h, n]: GQA mean of the last row
            parts[LAST] = inputs.probs[..., -1, :].float().mean(dim=2)
        return parts

    def score(self, inputs: PrefillInputs):
        return self.score_parts(inputs)["scores"]

    def _lenders(self, plan, window: int, sinks: torch.Tensor) -> torch.Tensor:
        """``[b, h, n]`` bool: the carry's ``carry_count`` lenders of ``plan``'s heads, outside the window and
        ``sinks``, ranked by the last window query's attention where it was kept (not under the repeat
        pass), else by the head's scores."""
        return scoring.top_tokens(plan.parts.get(LAST, plan.scores), self.carry_count, plan.key_valid, window, sinks)

    def global_scores(self, plan, scores):
        """Under ``carry_budget``: the ``global`` budget's ``scores [b, h, n]`` carried forward from the
        carry's lenders (the ``carry_count`` tokens the window's last query reads most, outside the window
        and the sinks; with ``carry_budget_min`` > 0 only those it reads with at least that attention) over
        ``carry_len`` tokens with ``carry`` (docs/method.md#the-rule-for-carry_budget-written-2026-12-05-eighth-session-after-exploratory-tuning-probes-before-its-judged-runs)."""
        if not self.carry_budget:
            return scores
        key_valid = plan.key_valid.to(scores.device)
        lenders = self._lenders(plan, plan.window, scoring.first_valid(key_valid, self.sinks))
        if self.carry_budget_min > 0 and LAST in plan.parts:
            lenders &= plan.parts[LAST].float().to(scores.device) >= self.carry_budget_min
        return carrying.carry_forward(scores, key_valid.long(), self.carry, self.carry_len, lenders)

    def across_layers(self, plans, key_valid, window) -> None:
        if not plans:
            return
        # Unit labels [b, n] (jacap_attn.selection.units.label_units), absent without units or their vocabulary.
        labels = plans[0].parts.get(PART) if self.units != "none" else None
        # Without units the carry's reach is `carry_len` alone (QuerySpanPress's, bounded): one unit
        # per row, the left padding (or a held index space's evicted indices) another.
        reach = labels if self.units != "none" else key_valid.long()
        runs = plans[0].parts.get(LOOKUP) if self.lookup else None  # [b, n]: the same runs in every head
        # Every layer's rows at once where the plans allow (the same arithmetic per row, one call per step)
        groups, count = fold_plans(plans, (LAST, lookup.ROOM, "leverage"))
        rows_valid = repeat_rows(key_valid, count)
        # (plan, [b, h, n] strength of each forced run, the share of the free budget it may take, the threshold,
        # the free budget below which a head forces nothing)
        forced = []  # under carry_force the attention of each run's strongest lender; under lookup its match length
        if self.carry and reach is not None:
            reach = repeat_rows(reach, count)
            sinks = scoring.first_valid(rows_valid, self.sinks) if self.carry_count else None
            for p in groups:
                sources = None if self.carry_top >= 1.0 else scoring.top_of_budget(
                    p.scores, p.head_budgets, p.key_valid, window, self.sinks, self.carry_top)
                if self.carry_peak > 0:
                    peak = scoring.peaks(p.scores, p.key_valid, self.carry_peak)
                    sources = peak if sources is None else sources & peak
                if self.carry_count:  # the head's few best tokens only (not its sinks)
                    top = self._lenders(p, window, sinks)
                    sources = top if sources is None else sources & top
                    if self.carry_force > 0 and LAST in p.parts:  # runs read this strongly are kept by force
                        read = p.parts[LAST].float().to(p.scores.device)
                        strong = top & (read >= self.carry_force)
                        forced.append((p, carrying.carry_forward(read.masked_fill(~strong, 0.0), reach.to(read.device),
                                                                 1.0, min(self.carry_len, self.unit_len), strong),
                                       self.carry_force_share, self.carry_force, 0, None))
                p.scores = carrying.carry_forward(p.scores, reach.to(p.scores.device), self.carry,
                                                  min(self.carry_len, self.unit_len), sources)
        if self.consensus > 0:
            consensus = scoring.consensus_scores([p.parts["leverage"] for p in groups], rows_valid)
            consensus = consensus.view(count, -1, consensus.shape[-1]).amax(0)  # [b, n]: the best over layers
            # The sinks are kept anyway: they must not spend the consensus share (nor drag the
            # tokens after them in through the forward pooling).
            sinks = scoring.first_valid(key_valid, self.sinks)
            consensus = consensus.masked_fill(sinks.to(consensus.device), 0.0)
            if labels is not None:  # to the end of the unit: a key's clause and the value in it
                consensus = carrying.carry_forward(consensus[:, None], labels.to(consensus.device), 1.0,
                                                   self.unit_len)[:, 0]
            else:
                consensus = scoring.pool_scores(consensus[:, None], "forward", self.consensus_kernel)[:, 0]
            consensus, reserved = repeat_rows(consensus, count), repeat_rows(sinks.sum(-1), count)
            for p in groups:
                p.scores = scoring.blend_consensus(p.scores, consensus.to(p.scores.device), p.head_budgets, window,
                                                   self.consensus, reserved.to(p.head_budgets.device))
        if runs is not None:
            runs = repeat_rows(runs, count)
            forced += [(p, runs[:, None].to(p.scores.device).expand_as(p.scores), self.lookup_share, lookup.FLOOR,
                        self.lookup_free, p.parts.get(lookup.ROOM)) for p in groups]
        for p, strength, cap, threshold, floor, room in forced:
            counts = None
            # room [b, h]: what the cut added to each head's budget for these runs (selection.units.hold_ahead)
            room = 0 if room is None else room.to(p.scores.device)
            if cap < 1.0 or floor:
                free = free_budget(p.head_budgets.to(p.scores.device) - room, window, p.scores.shape[-1], self.sinks)
                counts = torch.floor(cap * free.double()).to(torch.int64) if cap < 1.0 else torch.full_like(
                    free, p.scores.shape[-1])  # 1: no cap
                counts = counts.masked_fill(free < floor, 0) + room
            p.scores = carrying.force_runs(p.scores, strength, threshold, counts, p.key_valid, window)
        if self.sinks:
            for p in groups:
                p.scores = scoring.keep_sinks(p.scores, rows_valid.to(p.scores.device), self.sinks)
        unfold_scores(groups, plans, count)
