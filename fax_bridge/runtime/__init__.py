"""Runtime: interprets federated_language Computation protos (coordinator side)."""
