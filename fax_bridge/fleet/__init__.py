"""Fleet: device processes hosting virtual clients, the gRPC clients backend, a local launcher."""
