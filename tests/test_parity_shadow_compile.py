"""How the float64 shadow's programs are compiled (`parity.shadow_compile`): a small
program quickly, a large one optimized, by its flops with every loop at its full length."""

import jax
import jax.numpy as jnp

import fax_bridge as fb
from fax_bridge.language.tracing import trace
from fax_bridge.parity import shadow as parity_shadow
from fax_bridge.parity import shadow_compile


@fb.program(clients=2)
def _small(w, x):
    """A few hundred flops a run, a loop of 12 steps among them."""
    def local(w, x):
        return jax.lax.scan(lambda h, xt: (jnp.tanh(xt @ w + h), None),
                            jnp.zeros(w.shape[1]), x)[0]

    return fb.federated_mean(fb.federated_map_clients(local, (fb.federated_broadcast(w), x)))


def _programs_options(fn, *args, placements="clients"):
    """The compile options the shadow chose for `fn`'s float64 program at `args`."""
    comp = trace(fn, *args, placements=placements)
    parity_shadow.measure(comp, args, samples=1)
    programs, _ = parity_shadow._compiled(comp.jaxpr)
    (options,) = [o for p in programs.values() for o in p.chosen.values()]
    return options


def test_loop_factor_is_the_longest_path_of_nested_loop_lengths():
    def nested(x):
        def outer(c, _):
            return jax.lax.scan(lambda h, _: (h * 2.0, None), c, None, length=7)[0], None

        y = jax.lax.scan(outer, x, None, length=5)[0]
        return jax.lax.scan(lambda h, _: (h + 1.0, None), y, None, length=3)[0]

    assert shadow_compile.loop_factor(jax.make_jaxpr(nested)(1.0)) == 35.0
    assert shadow_compile.loop_factor(jax.make_jaxpr(lambda x: x + 1.0)(1.0)) == 1.0
    spin = jax.make_jaxpr(lambda x: jax.lax.while_loop(lambda v: v < 3.0,
                                                       lambda v: v + 1.0, x))(0.0)
    assert shadow_compile.loop_factor(spin) == float("inf")


@fb.program(clients=2)
def _conv_round(k, x):
    def local(k, x):
        dn = ("NHWC", "HWIO", "NHWC")
        h = jax.lax.conv_general_dilated(x, k, (2, 2), "SAME", dimension_numbers=dn)
        return jnp.tanh(h).mean(0)

    return fb.federated_mean(fb.federated_map_clients(local,
                                                      (fb.federated_broadcast(k), x)))


def test_a_large_program_is_compiled_optimized_and_a_small_one_quickly():
    """Unoptimized, XLA's CPU code runs a convolution's float64 round many times slower
    than optimizing it costs to compile: the shadow optimizes past `shadow_compile.QUICK_WORK` flops."""
    small = _programs_options(_small, jnp.ones((3, 4)), jnp.ones((2, 12, 3)),
                              placements=("server", "clients"))
    assert small == shadow_compile.QUICK
    k = jnp.ones((3, 3, 4, 16)) * 0.1
    x = jnp.ones((2, 64, 28, 28, 4))  # 2 clients x 64 images: ~1e8 flops a run
    big = _programs_options(_conv_round, k, x, placements=("server", "clients"))
    assert big == {}
