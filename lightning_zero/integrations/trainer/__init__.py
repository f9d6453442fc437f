"""``Trainer(strategy="zero")``: the strategy, its checkpoint hooks, precision, callbacks and loader."""
