"""Pure tensor functions of the selection: window attention and scores, the baselines' scores, attention statistics, budgets (no module, cache or config; docs/architecture.md#package-layout)."""
