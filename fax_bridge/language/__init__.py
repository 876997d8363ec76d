"""The federated language: the primitives and the facts each registers, their
per-client rules, placements, tracing to a placed jaxpr, how the primitives lower
under jit, secure aggregation, and the names of a pytree's children.
"""
