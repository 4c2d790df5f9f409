"""Schedule generators, one module per family."""
