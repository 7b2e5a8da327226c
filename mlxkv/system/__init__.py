"""What the machine has and where things go: BLAS, memory, paths, logging."""
