"""Rounds' client parts as LiteRT (TensorFlow Lite) models, run by the LiteRT interpreter.

`convert` makes a round split's client part a `.tflite` with one named signature (the
converter runs in its own environment: `side_convert.py`), `runner` runs it over a
holder's clients and gives the exact partials the XLA path gives (`runner.
LiteRTClientRuntime`, a `rounds.client_runtime`), `manifest` and `cli` write models for a
mobile developer (`fax-bridge litert`). See docs/litert.md.
"""
