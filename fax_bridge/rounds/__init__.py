"""Rounds: a round-shaped computation split once and run end to end over any transport.

The layer between the proto machine (`fax_bridge.runtime`) and the transports
(`fax_bridge.in_process`, the gRPC device fleet `fax_bridge.fleet`, Flower's Deployment
Engine `fax_bridge.flower`), which import it and never each other:

- `round_split`: a round split once into server prepare, one client part, aggregations
  and server result; `server_steps` runs the two server pieces.
- `engine`: one round of a split over a `Transport` (`run_round`), every answer checked
  before any is merged (`check_and_merge`), and the round's policy applied once
  (`open_round`, `drop_lost`).
- `cohort`: how many clients a round has, derived and checked once (`Cohort.of`) and
  handed to every transport.
- `policy`: who takes part in a round and how it behaves (`RoundPolicy`, `plan_round`),
  what it reports (`RoundReport`, `Traffic`); `ids`: sets of client ids.
- `wire` and `partials`: values and partials as messages (bytes, or a span a transport
  resolves); `validate`: whether an answer could be honest.
- `checkpoint`: checkpoint files of a run of rounds.
"""
