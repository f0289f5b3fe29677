"""Layer 4: one request's decoding rules: sampling, grammar constraints and tool calls, logprobs, the request's
state and stop rules, and the lossless acceptance of a draft tree (`verification`)."""
