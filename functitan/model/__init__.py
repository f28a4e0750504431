"""Models as values: one declaration per parameter, and the interface the trainer and every tool take.

    from functitan.model import Model, Param, normal, ones, zeros, init, specs, count, load_model

    def params(cfg):                               # the one declaration of every parameter
        return {"w": Param((cfg.out, cfg.dim), ("mlp", "embed"), normal(0.02)), ...}

    MODEL = Model(name="mine", configs={"debug": Cfg()}, params=params, loss=loss, apply=apply,
                  flops_per_token=flops)

    functitan train --model.name=path/to/mine.py --parallelism.dp_shard=2 --nproc 2

``init``, ``specs``, ``count`` and meta-device init derive from the declaration; ``check_names`` verifies that
every contraction names a parameter's dims as declared; ``gradcheck`` compares a model's gradients under
FSDP, HSDP, TP and TP + SP with one process and lists every parameter that differs (docs/models.md).
"""

from .._loss import TokenLoss
from ._check import check_names
from ._gradcheck import GRADCHECK_LAYOUTS, gradcheck
from ._model import HFMap, Model, TensorKey, config_from_dict, config_to_dict, transformers_major
from ._param import Param, constant, count, expert_count, init, is_param, normal, ones, shapes, specs, uniform, zeros
from ._pieces import Pieces
from ._resolve import ENTRY_POINT_GROUP, load_model, model_for_architecture

__all__ = [
    "Param",
    "TokenLoss",
    "normal",
    "uniform",
    "constant",
    "zeros",
    "ones",
    "is_param",
    "init",
    "specs",
    "shapes",
    "count",
    "expert_count",
    "Model",
    "Pieces",
    "HFMap",
    "TensorKey",
    "config_to_dict",
    "config_from_dict",
    "transformers_major",
    "load_model",
    "model_for_architecture",
    "ENTRY_POINT_GROUP",
    "check_names",
    "gradcheck",
    "GRADCHECK_LAYOUTS",
]
