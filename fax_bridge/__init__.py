"""fax_bridge: federated computations in JAX, run locally or exported to TFF."""
