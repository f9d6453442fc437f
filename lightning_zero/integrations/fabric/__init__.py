"""``Fabric(strategy="zero")``: the strategy and its checkpoint hooks."""
