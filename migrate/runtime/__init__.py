"""What the commands need around their work: shared argument plumbing, the memory estimate,
simulated devices."""
