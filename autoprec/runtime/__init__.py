"""Runtime pieces used while training: loss scaling, monitoring, applying a policy (DESIGN §7)."""
