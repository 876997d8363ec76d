"""Generated gRPC modules of the fax_bridge.v1 device protocol (see protos/; `make protos`)."""
