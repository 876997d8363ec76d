"""Rounds on Flower's Deployment Engine: a round as a Flower ServerApp and ClientApp.

`bundle` builds a round (refusing what one broadcast and aggregations cannot run) and
keeps it in a Flower app as `round.json`; `app_dir.write_app` writes that app (`cli`:
`fax-bridge flower`); `server.server_app` is its ServerApp and `relay.client_app` its
ClientApp, which computes through `client` in its own process or hands the round to a
SuperNode's warm `worker`; `records` lays a round's values out as Flower records;
`nodes` finds the SuperNodes and exchanges messages with them;
`deployment.LocalDeployment` starts a SuperLink and SuperNodes on loopback;
`load_result` reads a run's result back as the round's pytree and `compare_with_jit`
compares a run with jit (`results`). See docs/flower.md.
"""

from fax_bridge.flower.results import compare_with_jit, load_result  # noqa: E402

__all__ = ["compare_with_jit", "load_result"]
