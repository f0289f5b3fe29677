"""Layer 6: the engine: one request (`generator.Generator`) or a batch of them (`batch.Batch`), round by round
(`round`), each round's kind chosen by measured speed (`scheduler`)."""
