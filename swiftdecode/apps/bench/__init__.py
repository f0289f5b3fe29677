"""`swiftdecode bench`: decoding methods side by side on one model and prompt set, interleaved in one process.

Every method decodes the same prompt ids (chat template applied once) with the same max_new_tokens;
per prompt the methods run in rotation so machine drift hits all alike. A method's output is its new ids
cut before the first EOS (EOS excluded); that span is what is counted and compared. tokens/s = mean over
prompts of new_tokens / wall s (timed around the generate call); speedups are ratios of those means; under
greedy a method is lossless when every output is token-identical to the reference (`ar`, else `hf`), under
sampling when every output equals `ar`'s with the same seed (each prompt's seed is shared by all methods); `hf`'s
row then reports how far HF `generate` agrees with `ar` (`agreement`: share of tokens before the first
divergence), i.e. the cost of the quantized path's numerics.

Modules: `methods` (the methods and Outcome), `runners` and `hf` (one Runner per method), `stream` (the timed
run), `summary` (results.json), `report` (tables, results.md), `plots`, `cli`.
"""
