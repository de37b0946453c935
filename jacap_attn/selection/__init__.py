"""Selection: which entries a cache keeps. The cut in named steps (:mod:`.steps`, re-exported here:
``selection.cut``, ``selection.finalize_prefill``, ...), scoring one layer (:mod:`.scorer`), the
``global`` budget policy (:mod:`.global_budget`), word spans (:mod:`.spans`) and units larger than a
word (:mod:`.units`) (docs/architecture.md#the-cut)."""

from .steps import (KINDS, Cut, assign_head_budgets, assign_layer_budgets, close_spans, cut, finalize_prefill, gather,
                    held_plans, keep_special_tokens, prefill_plans, span_labels, special_token_ids)

__all__ = ["KINDS", "Cut", "assign_head_budgets", "assign_layer_budgets", "close_spans", "cut", "finalize_prefill",
           "gather", "held_plans", "keep_special_tokens", "prefill_plans", "span_labels", "special_token_ids"]
