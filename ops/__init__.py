"""Op contracts and their PyTorch references: one file per op; the reference is the oracle."""
