"""Rounds on Flower's Deployment Engine: a round as a Flower ServerApp and ClientApp.

`bundle` builds a round (refusing what one broadcast and aggregations cannot run) and
keeps it in a Flower app as `round.json`; `app_dir.write_app` writes that app (`cli`:
`fax-bridge flower`); `server.server_app` is its ServerApp and `relay.client_app` its
ClientApp, which computes through `client` in its own process or hands the round to a
SuperNode's warm `worker`; `records` lays a round's values out as Flower records;
`nodes` finds the SuperNodes and exchanges messages with them;
`deployment.LocalDeployment` starts a SuperLink and SuperNodes on loopback. A run's
result read back as the round's pytree, and a run compared with jit:
`fax_bridge.parity.flower_results` (`load_result`, `compare_with_jit`). See docs/flower.md.
"""
