"""functitan: JAX-style functional distributed training on PyTorch.

Models are pure functions over parameter pytrees; a spec tree names every parameter dim, one rules table
maps the names to the axes of a named mesh, and transforms turn ``loss_fn(params, batch)`` into a
distributed train step. The submodules are imported explicitly (nothing happens at import)::

    from functitan import optim, pipeline, checkpoint, metrics
    from functitan.mesh import make_mesh
    from functitan.sharding import Layout, default_rules, place
    from functitan.transforms import value_and_grad, accumulate, remat
    from functitan.step import make_train_step
    from functitan.train_state import TrainState
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
