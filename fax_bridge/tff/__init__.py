"""Export of federated programs to TFF building-block protos (types, Xla parts, exporter)."""
