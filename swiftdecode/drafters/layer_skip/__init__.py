"""The layer-skip drafter: the model itself with some sublayers skipped drafts on its own KV cache; its skip set
is searched on the fly (`search`, `tuner`), starting from the prompt's collinearity and a timed cost model
(`profile`)."""
